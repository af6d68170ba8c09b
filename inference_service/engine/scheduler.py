"""Scheduler: which sequences run in the next step, and how many tokens each; the sole owner of
every Sequence from admission (add, schedule) through each step (postprocess) to finish.

FCFS under max_num_seqs, max_num_batched_tokens and the KV cache, plus the LoRA rule: every
running adapter is resident in adapter memory, so the adapters of a step are as many as fit in
it (small ranks and few targets take little), not a fixed count.
"""

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from inference_service.adapters.host_tier import HostTier, ReadyAdapter
from inference_service.engine.adapter_memory import AdapterMemory
from inference_service.engine.block_allocator import BlockAllocator
from inference_service.engine.config import EngineConfig
from inference_service.engine.sequence import Sequence, Status
from shared.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether the step draws a token for this sequence: its chunk reaches the prompt's end."""
        return self.seq.num_computed + self.num_tokens >= len(self.seq.prompt_token_ids)


@dataclass(frozen=True)
class SchedulerStats:
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    running_adapters: tuple[str, ...]  # adapter names of running requests, each once, oldest first
    waiting_adapters: tuple[str, ...]  # and of waiting ones


@dataclass(frozen=True)
class Schedule:
    chunks: list[ScheduledChunk]
    activations: list[tuple[int, ReadyAdapter]]  # (adapter handle, adapter) to copy in before the step
    refused: list[tuple[Sequence, FailedPrecondition]]  # adapter larger than all adapter memory: fail them


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,  # max_num_seqs, max_num_batched_tokens and block_size are read
        allocator: BlockAllocator,
        memory: AdapterMemory,
        host: HostTier,
    ):
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.block_size = config.block_size
        self.allocator, self.memory, self.host = allocator, memory, host
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}  # every sequence added and not finished

    def add(self, seq: Sequence) -> None:
        """Queue the sequence; its adapter starts loading now if the host tier has room."""
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq
        if seq.adapter:
            self.host.hold(seq.adapter)

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished sequence of that request, waiting or running; None if there is none."""
        return self._by_id.get(request_id)

    @property
    def sequences(self) -> list[Sequence]:
        """Every unfinished sequence, waiting or running, in the order they were added."""
        return list(self._by_id.values())

    def schedule(self) -> Schedule:
        budget = self.max_num_batched_tokens
        chunks = []
        for seq in self.running:
            n = (
                min(len(seq.prompt_token_ids) - seq.num_computed, budget)
                if seq.in_prefill
                else min(1, budget)
            )
            if n > 0:
                chunks.append(ScheduledChunk(seq, n))
                budget -= n
        schedule = Schedule(chunks, [], [])
        self._admit(budget, schedule)
        return schedule

    def _admit(self, budget: int, schedule: Schedule) -> None:
        """Admit waiting sequences in arrival order. A sequence whose adapter is still loading is
        skipped (nothing waits for a load); one whose adapter is larger than the whole adapter
        memory is refused (draining could never make room). When the oldest admissible one does
        not fit in adapter memory, the least recently acquired busy adapters that make room for
        it are drained: nobody new joins them and no later sequence brings another adapter in,
        so their memory frees up and that sequence gets it; later sequences on the other
        resident adapters keep being admitted."""
        draining: frozenset[int] | None = None  # set once the oldest admissible one waits for room
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            ready = self.host.get(seq.adapter) if seq.adapter else None
            if seq.adapter and ready is None:
                continue
            if self._blocks_for(seq) > self.allocator.num_free:
                return  # strict FCFS on memory: smaller requests do not overtake a big one
            if ready is not None:
                resident = self.memory.resident(ready.digest)
                if draining is not None and (resident is None or resident in draining):
                    continue
                need = ready.image.need
                if resident is None and not self.memory.fits(need):
                    schedule.refused.append((seq, self._too_large(seq, need)))
                    continue
                if resident is None and not self.memory.can_acquire(ready.digest, need):
                    draining = self.memory.drain_for(need)
                    continue
            n = min(len(seq.prompt_token_ids), budget)
            self._start(seq, ready, schedule.activations)
            schedule.chunks.append(ScheduledChunk(seq, n))
            budget -= n

    def _too_large(self, seq: Sequence, need: tuple[int, ...]) -> FailedPrecondition:
        total = self.memory.stats().bytes_total
        return FailedPrecondition(
            f"adapter {seq.adapter!r} needs {self.memory.bytes_for(need)} bytes of adapter memory; "
            f"this worker has {total} in all (--adapter-memory), so it can never be loaded"
        )

    def check_fits(self, seq: Sequence) -> None:
        """Refuse a sequence the KV cache could never hold: every position's block is reserved at
        admission, so it would wait forever and hold back every request behind it."""
        if self._blocks_for(seq) > self.allocator.num_blocks:
            raise InvalidArgument(
                f"prompt ({len(seq.prompt_token_ids)} tokens) + max_tokens ({seq.params.max_tokens}) needs "
                f"{seq.max_len} tokens of KV cache; this worker's KV cache holds "
                f"{self.allocator.num_blocks * self.block_size} (--kv-cache-tokens); lower max_tokens or "
                "shorten the prompt"
            )

    def _blocks_for(self, seq: Sequence) -> int:
        """KV blocks for every position the sequence can reach, reserved at admission."""
        return -(-seq.max_len // self.block_size)

    def _start(self, seq: Sequence, ready: ReadyAdapter | None, activations: list) -> None:
        self.waiting.remove(seq)
        seq.block_table = self.allocator.allocate(self._blocks_for(seq))
        if ready is not None:
            self.host.release(seq.adapter)
            seq.slot, activate = self.memory.acquire(ready.digest, ready.image.need, self._waiting_digests())
            if activate:
                activations.append((seq.slot, ready))
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _waiting_digests(self) -> frozenset[str]:
        """The adapters waiting requests use that are ready in host memory."""
        ready = (self.host.peek(seq.adapter) for seq in self.waiting if seq.adapter)
        return frozenset(r.digest for r in ready if r is not None)

    def stats(self) -> SchedulerStats:
        total = self.allocator.num_blocks
        return SchedulerStats(
            len(self.waiting),
            len(self.running),
            total - self.allocator.num_free,
            total,
            _adapter_names(self.running),
            _adapter_names(self.waiting),
        )

    def postprocess(self, chunks: list[ScheduledChunk], sampled: list[tuple[Sequence, int]]) -> None:
        """After a step ran: each chunk's tokens are in the KV cache, and each (sequence, token)
        drawn joins that sequence's output."""
        for chunk in chunks:
            chunk.seq.num_computed += chunk.num_tokens
        for seq, token in sampled:
            seq.output_token_ids.append(token)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free what the sequence holds; safe for waiting, running and finished sequences alike."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.allocator.free(seq.block_table)
            if seq.slot >= 0:
                self.memory.release(seq.slot)
        else:
            self.waiting.remove(seq)
            if seq.adapter:
                self.host.release(seq.adapter)
        del self._by_id[seq.request_id]
        seq.block_table, seq.slot = [], -1
        seq.status, seq.finish_reason = Status.FINISHED, reason


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The adapters of `seqs` (base-model sequences left out), each once, in order."""
    return tuple(dict.fromkeys(seq.adapter for seq in seqs if seq.adapter))

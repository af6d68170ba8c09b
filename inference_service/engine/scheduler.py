"""Scheduler: which sequences run in the next step, and how many tokens each; the sole owner of
every Sequence from admission (add, schedule) through each step (postprocess) to finish, and of
the KV cache's blocks (BlockManager).

FCFS under max_num_seqs, max_num_batched_tokens and the KV cache, plus the LoRA rule: every
running adapter is resident in adapter memory, so the adapters of a step are as many as fit in
it (small ranks and few targets take little), not a fixed count.

KV blocks are taken as sequences grow: admission takes those of the prompt's first chunk (less
what the prefix cache holds), a running sequence one more at each block boundary. When a running
sequence cannot grow, the most recently admitted one is preempted (its blocks and adapter
reference given back), waits at the head of the queue and is computed again later, mostly from
the prefix cache. Running sequences are scheduled oldest first, so the victim is never one this
step already scheduled (vLLM's issue 23347) and the oldest can always grow: it always finishes.
A step that preempted admits nobody.
"""

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.adapters.host_tier import HostTier, ReadyAdapter, Version
from inference_service.engine.adapter_memory import AdapterMemory
from inference_service.engine.block_manager import BlockManager, adapter_key, chain
from inference_service.engine.config import EngineConfig
from inference_service.engine.sequence import Sequence, Status
from shared.errors import FailedPrecondition


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether the step draws a token for this sequence: its chunk reaches its last token
        (the prompt's, or after a preemption the last it had drawn)."""
        return self.seq.num_computed + self.num_tokens >= self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerStats:
    waiting: int
    running: int
    kv_blocks_used: int  # held by running sequences
    kv_blocks_cached: int  # held by none, kept for the prefix cache until a new block needs them
    kv_blocks_total: int
    running_adapters: tuple[str, ...]  # adapter names of running requests, each once, oldest first
    waiting_adapters: tuple[str, ...]  # and of waiting ones
    preemptions: int
    prefix_cache_queries: int  # tokens of admitted sequences, as vLLM counts them
    prefix_cache_hits: int  # of those, tokens found in the prefix cache


@dataclass(frozen=True)
class Schedule:
    chunks: list[ScheduledChunk]
    activations: list[tuple[int, ReadyAdapter]]  # (adapter handle, adapter) to copy in before the step
    refused: list[tuple[Sequence, FailedPrecondition]]  # adapter larger than all adapter memory: fail them


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,  # max_num_seqs, max_num_batched_tokens and block_size are read
        blocks: BlockManager,
        memory: AdapterMemory,
        host: HostTier,
    ):
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.block_size = config.block_size
        self.blocks, self.memory, self.host = blocks, memory, host
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._by_id: dict[str, Sequence] = {}  # every sequence added and not finished
        self.preemptions = self.prefix_cache_queries = self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        """Queue the sequence; its adapter starts loading now if the host tier has room. A
        sequence that knows its adapter's content is bound to it from now on; one that does not
        (the adapter store's catalog view is down) is bound to the first version it finds ready."""
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq
        if seq.adapter:
            self.host.hold(seq.adapter, seq.digest)
            if seq.digest:
                self.host.bind(Version(seq.adapter, seq.digest))

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished sequence of that request, waiting or running; None if there is none."""
        return self._by_id.get(request_id)

    @property
    def sequences(self) -> list[Sequence]:
        """Every unfinished sequence, waiting or running, in the order they were added."""
        return list(self._by_id.values())

    def schedule(self) -> Schedule:
        schedule = Schedule([], [], [])
        budget, preempted = self._schedule_running(schedule.chunks)
        if not preempted:  # the memory a preemption freed is for the running ones' next steps
            self._admit(budget, schedule)
        return schedule

    def _schedule_running(self, chunks: list[ScheduledChunk]) -> tuple[int, bool]:
        """Chunks of the running sequences, oldest first, each with the blocks it grows into;
        returns the budget left and whether a sequence was preempted for room."""
        budget, preempted = self.max_num_batched_tokens, False
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted for an older one in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n <= 0:
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]  # newer than seq, or seq itself: not scheduled yet
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, n))
                budget -= n
        return budget, preempted

    def _grow(self, seq: Sequence, positions: int) -> bool:
        """Give the sequence blocks for its first `positions` positions; False if too few are free."""
        need = -(-positions // self.block_size) - len(seq.block_table)
        if need > self.blocks.num_free:
            return False
        if need > 0:
            seq.block_table += self.blocks.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Take a running sequence's blocks and adapter reference back; it waits at the head of
        the queue, to be computed again from its first token (its named blocks stay cached)."""
        self.running.remove(seq)
        self._give_back(seq)
        seq.num_computed, seq.status = 0, Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        if seq.adapter:
            self.host.keep(seq.adapter, seq.digest)

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
            ready = self.host.get(seq.adapter, seq.digest) if seq.adapter else None
            if seq.adapter and ready is None:
                continue
            if ready is not None and seq.digest is None:
                seq.digest = ready.digest
                self.host.bind(ready.version)
            hits = self._cached_prefix(seq)
            n = min(seq.num_tokens - len(hits) * self.block_size, budget)
            new_blocks = -(-(len(hits) * self.block_size + n) // self.block_size) - len(hits)
            if new_blocks > self.blocks.num_free - self.blocks.free_among(hits):
                return  # strict FCFS on memory: smaller requests do not overtake a big one
            if ready is not None:
                resident = self.memory.resident(ready.digest)
                if draining is not None and (resident is None or resident in draining):
                    continue
                need = ready.image.need
                if resident is None and not self.memory.fits(need):
                    schedule.refused.append((seq, self._too_large(seq, ready.image)))
                    continue
                if resident is None and not self.memory.can_acquire(ready.digest, need):
                    draining = self.memory.drain_for(need)
                    continue
            self._start(seq, ready, hits, n, schedule.activations)
            schedule.chunks.append(ScheduledChunk(seq, n))
            budget -= n

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of the sequence's first full blocks under the adapter content it is
        bound to, never its last token's block: that token is always computed, for its logits."""
        if not self.blocks.prefix_caching:
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        return self.blocks.cached_prefix(self._hashes(seq, usable)[:usable])

    def _too_large(self, seq: Sequence, image: AdapterImage) -> FailedPrecondition:
        total = self.memory.stats().bytes_total
        parts = f" (of them, its {image.vocab.sizes(image.pages[-1].dtype)})" if image.vocab else ""
        return FailedPrecondition(
            f"adapter {seq.adapter!r} needs {self.memory.bytes_for(image.need):,} bytes of adapter memory"
            f"{parts}; this worker has {total:,} in all (--adapter-memory), so it can never be loaded"
        )

    def _start(
        self, seq: Sequence, ready: ReadyAdapter | None, hits: list[int], n: int, activations: list
    ) -> None:
        """Admit a waiting sequence: its cached prefix, blocks for its first chunk of n tokens,
        and its adapter's memory (an activation if the adapter is not resident)."""
        self.waiting.remove(seq)
        self.blocks.take(hits)
        seq.block_table = list(hits)
        seq.num_computed = len(hits) * self.block_size
        seq.hit_blocks = seq.named_blocks = len(hits)
        self._grow(seq, seq.num_computed + n)
        if seq.preemptions == 0:
            seq.cached_tokens = seq.num_computed
        if self.blocks.prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed
        if ready is not None:
            self.host.release(seq.adapter)
            seq.slot, activate = self.memory.acquire(ready.digest, ready.image.need, self._waiting_digests())
            if activate:
                activations.append((seq.slot, ready))
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _waiting_digests(self) -> frozenset[str]:
        """The adapter contents waiting requests are bound to."""
        return frozenset(seq.digest for seq in self.waiting if seq.digest)

    def stats(self) -> SchedulerStats:
        blocks = self.blocks
        return SchedulerStats(
            len(self.waiting),
            len(self.running),
            blocks.num_blocks - blocks.num_free,
            blocks.num_cached_free,
            blocks.num_blocks,
            _adapter_names(self.running),
            _adapter_names(self.waiting),
            self.preemptions,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
        )

    def postprocess(self, chunks: list[ScheduledChunk], sampled: list[tuple[Sequence, int]]) -> None:
        """After a step ran: each chunk's tokens are in the KV cache, each (sequence, token)
        drawn joins that sequence's output, and the blocks the step filled join the prefix cache."""
        for chunk in chunks:
            chunk.seq.num_computed += chunk.num_tokens
        for seq, token in sampled:
            seq.output_token_ids.append(token)
            if seq.penalties is not None:
                seq.penalties.add(token)
            if seq.matcher is not None:
                seq.matcher.consume_token(token)
        if self.blocks.prefix_caching:
            for chunk in chunks:
                self._name_full_blocks(chunk.seq)

    def _name_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.block_size
        if full <= seq.named_blocks:
            return
        hashes = self._hashes(seq, full)
        for b in range(seq.named_blocks, full):
            self.blocks.name(seq.block_table[b], hashes[b])
        seq.named_blocks = full

    def _hashes(self, seq: Sequence, blocks: int) -> list[bytes]:
        """The hashes of at least the sequence's first `blocks` full blocks, each computed once
        (a waiting sequence is looked up at every step)."""
        if len(seq.block_hashes) < blocks:
            key = adapter_key(seq.digest)  # bound before any hash: the base model's only without an adapter
            seq.block_hashes = chain(seq.token_ids, self.block_size, key, seq.block_hashes)
        return seq.block_hashes

    def drop_computed(self, seq: Sequence) -> list[int]:
        """A running sequence's logits came out NaN or Inf: the blocks it computed (not those it
        found cached) leave the prefix cache; returns those only it holds, to be wiped before
        anyone else gets them."""
        return self.blocks.forget(seq.block_table[seq.hit_blocks :])

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free what the sequence holds; safe for waiting, running and finished sequences alike."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._give_back(seq)
        else:
            self.waiting.remove(seq)
            if seq.adapter:
                self.host.release(seq.adapter)
        if seq.adapter and seq.digest:
            self.host.unbind(Version(seq.adapter, seq.digest))
        del self._by_id[seq.request_id]
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _give_back(self, seq: Sequence) -> None:
        """A running sequence's blocks and adapter memory reference."""
        self.blocks.free(seq.block_table)
        if seq.slot >= 0:
            self.memory.release(seq.slot)
        seq.block_table, seq.slot, seq.named_blocks, seq.hit_blocks = [], -1, 0, 0


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The adapters of `seqs` (base-model sequences left out), each once, in order."""
    return tuple(dict.fromkeys(seq.adapter for seq in seqs if seq.adapter))

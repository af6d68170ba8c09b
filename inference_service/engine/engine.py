"""Engine: continuous batching of many requests over many adapters on one model.

Each step runs one flattened batch (decode tokens of running sequences plus prefill chunks of
new ones), then samples, detokenizes and emits one Delta per request that made progress.
`generate` drives steps in the caller's thread; `start` runs them in a background thread for
`stream`, the asyncio API. Public methods are thread-safe, and only `add_adapter`'s read of a
checkpoint takes time: no call waits for a step. `submit` and `abort` post to an inbox the
stepping thread applies at the start of the next step; adapter changes apply at once when no step
runs, else the same way. Stats and adapter listings read a snapshot published after every step
and change (GetStats, /metrics and ListAdapters answer while a long step runs).

Faults: an adapter whose weights cannot be copied into a slot, or a request whose logits come
out NaN or Inf, fails only its own requests. Any other exception, or a step running past
`step_timeout_s`, ends every request with Unavailable (see EngineThread): no stream waits on a
dead engine.
"""

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from inference_service.adapters.host_tier import AdapterLoader, HostTier, ReadyAdapter
from inference_service.adapters.local_loader import LocalAdapterLoader
from inference_service.engine.adapter_memory import AdapterMemory
from inference_service.engine.block_manager import BlockManager
from inference_service.engine.config import EngineConfig
from inference_service.engine.delta_queue import DeltaQueue
from inference_service.engine.engine_thread import EngineThread
from inference_service.engine.grammars import Grammars
from inference_service.engine.inbox import Inbox
from inference_service.engine.metrics import EngineMetrics, EngineStats
from inference_service.engine.model_runner import ModelRunner
from inference_service.engine.request import Delta, Request, RequestOutput, Sink
from inference_service.engine.request_errors import left_constraint, overflowed
from inference_service.engine.sampler import generator_for
from inference_service.engine.scheduler import ScheduledChunk, Scheduler
from inference_service.engine.sequence import Sequence, Status
from inference_service.engine.snapshot import AdapterState, Snapshot
from inference_service.engine.streams import Streams
from inference_service.engine.tokenizer import Tokenizer
from inference_service.torch_threads import in_passing_thread, per_rank
from shared.base_vocab import BaseVocab
from shared.errors import FailedPrecondition, LoramuxError, NotFound, Unavailable, brief
from shared.model_config import ModelConfig
from shared.names import check_adapter_id

__all__ = ["Engine"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, loader: AdapterLoader | None = None):
        self.config = config
        self.runner = in_passing_thread(ModelRunner.start, config)  # its parallel ops' team ends there
        model = self.runner.model_config
        tokenizer_json = Path(config.model) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_dir(config.model) if tokenizer_json.is_file() else None
        self.eos_token_ids = eos = self.tokenizer.eos_token_ids if self.tokenizer else model.eos_token_ids
        self.grammars = Grammars(tokenizer_json, model.vocab_size, eos, config.grammar_compile_timeout_s)
        shard = self.runner.parallel.shard
        self.loader = loader or LocalAdapterLoader(
            model, config.max_lora_rank, config.torch_dtype, shard, BaseVocab(config.model, model)
        )
        self._wakeup = threading.Event()  # set when a step has something new: a submit, a load
        pinned = self.runner.device.type == "cuda"
        self.host = HostTier(config.max_cpu_loras, self.loader, pinned, self._wakeup.set)
        rank = self.runner.rank_config  # adapter memory holds this rank's part of each adapter
        self.memory = AdapterMemory.for_model(self.runner.lora_units, rank, config.torch_dtype)
        blocks = BlockManager(self.runner.num_blocks, config.prefix_caching)
        self.scheduler = Scheduler(config, blocks, self.memory, self.host)
        self.streams = Streams(self.tokenizer, eos)
        self.metrics = EngineMetrics()
        self._inbox = Inbox(self._wakeup)
        self._publish()
        # Ranks on the CPU share its cores: rank 0's steps take its share, as the others do.
        split = config.tensor_parallel_size > 1 and self.runner.device.type == "cpu"
        threads = per_rank(config.tensor_parallel_size) if split else None
        self._thread = EngineThread(
            self.step, lambda: self.has_work, self._wakeup, config.step_timeout_s, threads
        )
        self._thread.on_fatal(self.streams.close_all)
        self._thread.on_fatal(lambda _: self.runner.abort())

    # --- adapters -------------------------------------------------------------------------

    def add_adapter(self, name: str, peft_dir: str | Path) -> str:
        """Validate and optimize a local PEFT adapter and put it in the host tier; returns its
        content digest. Re-adding a name replaces its weights for requests submitted from now
        on; those submitted before finish on the weights they were submitted with."""
        check_adapter_id(name)
        if not isinstance(self.loader, LocalAdapterLoader):
            raise FailedPrecondition(f"adapter {name!r}: this engine's adapters come from the adapter store")
        # slow: in a passing thread like the model's build, before anything else sees it
        ready = in_passing_thread(lambda: self.host.prepare(self.loader.read(name, peft_dir)))
        self.loader.register(name, peft_dir, ready.digest)

        def install() -> None:
            self.host.put(ready)
            self.host.prune(name)

        self._change(install)
        return ready.digest

    def adapter_changed(self, name: str) -> None:
        """The loader gives `name` new content (the store re-registered it): host copies of its
        old content go, but for those requests submitted before still run on."""
        self._change(lambda: self.host.prune(name))

    def remove_adapter(self, name: str, missing_ok: bool = False) -> None:
        """New requests for `name` get NotFound at once; requests submitted before finish on
        the weights they were submitted with, through preemption and reload; its host copies go
        once those end."""
        if not missing_ok:
            self._require_adapter(name)
        self.loader.unregister(name)
        self._change(lambda: self.host.remove(name))

    def pin_adapter(self, name: str) -> None:
        self._require_adapter(name)
        self._change(lambda: self.host.pin(name))

    def unpin_adapter(self, name: str) -> None:
        self._require_adapter(name)
        self._change(lambda: self.host.unpin(name))

    def held_digests(self) -> dict[str, str]:
        """Adapter name -> digest of every adapter ready in host memory, as of the last step."""
        return self._snapshot.held_digests()

    def adapter_states(self) -> list[AdapterState]:
        """Every adapter held, as of the last step: in a device slot, in host memory, or loading;
        by name."""
        return self._snapshot.adapters()

    def _change(self, action: Callable[[], None]) -> None:
        """Apply an adapter change now if no step runs, else at the start of the next one."""
        self._inbox.change(action, then=self._publish)

    def _publish(self) -> None:
        parts = (self.host.stats(), self.memory.stats(), self.scheduler.stats(), self.grammars.stats())
        stats = self.metrics.snapshot(*parts, self.runner.ranks, self.runner.parallel.seconds)
        self._snapshot = Snapshot(stats, self.host.held(), self.memory.resident_digests())

    def _require_adapter(self, name: str) -> None:
        if name not in self.loader:
            raise NotFound(f"adapter {name!r} is not registered")

    # --- requests -------------------------------------------------------------------------

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request; `sink` receives its deltas from the stepping thread. A constrained
        request's constraint is compiled first, while this thread waits (stream() waits without
        holding one)."""
        self._check(request)
        structured = request.params.structured
        self._enqueue(request, sink, None if structured is None else self.grammars.matcher(structured))

    def _check(self, request: Request) -> None:
        request.check(self.max_model_len, self.runner.model_config.vocab_size, self.tokenizer is not None)
        if request.adapter is not None:
            self._require_adapter(request.adapter)

    def _enqueue(self, request: Request, sink: Sink, matcher: object | None) -> None:
        # the content it keeps to its end
        digest = self.loader.digest_of(request.adapter) if request.adapter is not None else None
        generator = generator_for(request.params, self.runner.device)
        vocab_size = self.runner.model_config.vocab_size
        seq = Sequence.of(request, generator, digest, matcher, self.eos_token_ids, vocab_size)
        self.streams.open(seq, sink)
        self._inbox.post(lambda: self.scheduler.add(seq))

    def abort(self, request_id: str) -> None:
        """Finish the request at the next step: its KV blocks and slot reference are freed then."""
        self._inbox.post(lambda: self._abort(self.scheduler.get(request_id)))

    def abort_all(self) -> None:
        self._inbox.post(lambda: self._abort(*self.scheduler.sequences))

    def _abort(self, *seqs: Sequence | None) -> None:
        for seq in seqs:
            if seq is not None:  # already finished, or never submitted
                self._finish(seq, "abort")

    def generate(self, requests: list[Request], on_delta: Sink = lambda delta: None) -> list[RequestOutput]:
        """Run the requests to completion, stepping as the engine thread would (EngineThread.drive);
        outputs in request order. `on_delta` also gets each delta as its step ends."""
        if self._thread.started:
            raise RuntimeError("generate() drives steps itself; use stream() while the engine thread runs")
        deltas: dict[str, list[Delta]] = {r.request_id: [] for r in requests}

        def sink(delta: Delta) -> None:
            deltas[delta.request_id].append(delta)
            on_delta(delta)

        for r in requests:
            self.submit(r, sink)
        self._thread.drive(lambda: all(d and d[-1].finish_reason is not None for d in deltas.values()))
        return [RequestOutput.collect(deltas[r.request_id]) for r in requests]

    async def stream(self, request: Request) -> AsyncIterator[Delta]:
        """Deltas of one request as they are produced; closing the iterator aborts it. A consumer
        that falls behind gets what it missed joined into one delta (Delta.join), so it catches
        up in one message rather than one per step."""
        queue = DeltaQueue(asyncio.get_running_loop())
        self._check(request)
        matcher = None
        if request.params.structured is not None:  # compiled on a thread: the loop serves others
            matcher = await self.grammars.matcher_async(request.params.structured)
        self._enqueue(request, queue.put, matcher)
        finished = False
        try:
            while not finished:
                delta = Delta.join(await queue.take())
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.abort(request.request_id)

    # --- the engine thread ----------------------------------------------------------------

    def start(self) -> None:
        self.grammars.prepare()  # it stalls every thread a moment: before any request, not amid them
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop()
        self.grammars.close()
        self.host.close()
        self.runner.close()

    def on_fatal(self, callback: Callable[[Unavailable], None]) -> None:
        """`callback(error)` runs once if the engine thread dies (at once if it already has),
        after every request in flight has been ended with that error."""
        self._thread.on_fatal(callback)

    def stats(self) -> EngineStats:
        """Every counter and gauge as of the last step, for export; never waits for a step."""
        return self._snapshot.stats

    @property
    def model_config(self) -> ModelConfig:
        """The served model's architecture, as its config.json gives it."""
        return self.runner.model_config

    @property
    def quantization(self) -> str:
        """The linear layers' base weight format: the pre-quantized checkpoint's, or config.quantization."""
        return self.runner.quantization

    @property
    def linear_weight_bytes(self) -> int:
        """Bytes the linear layers' base weights take, in their format (config.quantization)."""
        return self.runner.linear_weight_bytes

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt plus output) one request may hold: the worker's limit or the model's."""
        return self.runner.max_model_len

    @property
    def has_work(self) -> bool:
        """Requests to run, or loads to install (a preloaded adapter lands without a request)."""
        return bool(self._inbox or self.scheduler.waiting or self.scheduler.running or self.host.loading)

    # --- one step -------------------------------------------------------------------------

    def step(self) -> None:
        with self._inbox.lock:
            ran = self._step_locked()
            self._publish()
        if not ran and self.host.loading:
            self._wakeup.wait(0.005)  # only loads are pending: wait for one, or for a submit
            self._wakeup.clear()

    def _step_locked(self) -> bool:
        """One step; False when nothing could be scheduled."""
        self._inbox.apply()
        self._collect_loads()
        schedule = self.scheduler.schedule()
        for seq, error in schedule.refused:
            self._finish(seq, "error", error)
        if not schedule.chunks:
            return bool(schedule.refused)
        for slot, ready in schedule.activations:
            self._activate(slot, ready)
        chunks = [c for c in schedule.chunks if c.seq.status is Status.RUNNING]
        chunks.sort(key=lambda c: c.seq.slot)  # grouped by adapter for LoRA
        if chunks:
            self._run(chunks)
        return True

    def _run(self, chunks: list[ScheduledChunk]) -> None:
        """Run the chunks, let the scheduler record what they computed and drew, stream it out."""
        out = self.runner.run(chunks)
        for seq in out.non_finite:
            # before anyone else gets its blocks: attention multiplies masked positions by 0, and
            # 0 x NaN is NaN
            self.runner.zero_blocks(self.scheduler.drop_computed(seq))
            self._finish(seq, "error", overflowed(seq, self.config.dtype))
        tokens = out.result.token_ids
        self.scheduler.postprocess(out.computed, list(zip(out.sampled, tokens, strict=True)))
        for seq, token, logprobs in zip(out.sampled, tokens, out.result.logprobs, strict=True):
            if seq.matcher is not None and seq.matcher.is_error():  # its token is not sent
                self._finish(seq, "error", left_constraint(seq))
                continue
            reason = self.streams.emit(seq, token, logprobs)
            if reason is None and seq.matcher is not None and seq.matcher.is_stopped():
                reason = "stop"  # the constraint's output is whole
            if reason is not None:
                self._finish(seq, reason)

    def _activate(self, slot: int, ready: ReadyAdapter) -> None:
        """Copy an adapter into its pages of adapter memory. Weights the memory cannot take fail
        only the requests for that adapter; it leaves the memory and the host tier (a later
        request loads it anew)."""
        try:
            self.runner.load_slot(slot, ready.image, self.memory.pages(slot), ready)
        except Exception as e:
            log.exception("adapter %r cannot be loaded into adapter memory", ready.name)
            reason = f"adapter {ready.name!r} cannot be loaded into device memory: {brief(e)}"
            self._fail_adapter(ready.name, ready.digest, FailedPrecondition(reason), slot)
            self.runner.clear_slot(slot)
            self.memory.vacate(slot)
            self.host.drop(ready.version)

    def _collect_loads(self) -> None:
        """Install finished loads. A failed load fails only the waiting requests that named it."""
        seconds, failed = self.host.collect()
        for took in seconds:
            self.metrics.adapter_load_seconds.observe(took)
        for name, digest, error in failed:
            self._fail_adapter(name, digest, error)

    def _fail_adapter(
        self, name: str, digest: str | None, error: LoramuxError, slot: int | None = None
    ) -> None:
        """Fail the requests waiting for content `digest` of adapter `name` (None: its current
        content) and those not bound yet that would get it, and those running in its `slot`."""
        current = digest in (None, self.loader.digest_of(name))
        for seq in self.scheduler.sequences:
            waits = seq.status is Status.WAITING and seq.adapter == name
            if (waits and (seq.digest == digest or (seq.digest is None and current))) or (
                slot is not None and seq.slot == slot
            ):
                self._finish(seq, "error", error)

    def _finish(self, seq: Sequence, reason: str, error: LoramuxError | None = None) -> None:
        self.scheduler.finish(seq, reason)
        self.metrics.count_finished(seq)
        self.streams.close(seq, error)

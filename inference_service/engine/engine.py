"""Engine: continuous batching of many requests over many adapters on one model.

Each step runs one flattened batch (decode tokens of running sequences plus prefill chunks of
new ones), then samples, detokenizes and emits one Delta per request that made progress.
`generate` drives steps in the caller's thread; `start` runs them in a background thread for
`stream`, the asyncio API. Public methods are thread-safe. `submit` and `abort` never wait for a
step (an event loop calls them): they post to an inbox the stepping thread applies at the start
of the next step. Adapter changes and snapshots take the step lock.

Faults: an adapter whose weights cannot be copied into a slot, or a request whose logits come
out NaN or Inf, fails only its own requests. Any other exception ends the engine thread, and a
step running past `step_timeout_s` (a hung device, a deadlock) is given up on by a watchdog: every
request in flight or waiting ends with Unavailable, new ones are refused, and the `on_fatal`
callbacks run, so the process can exit for its supervisor to restart it. No stream waits on a
dead engine.
"""

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inference_service.adapters.host_tier import AdapterLoader, HostTier, ReadyAdapter
from inference_service.adapters.local_loader import LocalAdapterLoader
from inference_service.engine.block_allocator import BlockAllocator
from inference_service.engine.config import EngineConfig
from inference_service.engine.detokenizer import IncrementalDetokenizer
from inference_service.engine.metrics import EngineMetrics, EngineStats
from inference_service.engine.model_runner import ModelRunner
from inference_service.engine.sampler import SampleResult, SamplingBatch, TokenLogprobs, generator_for, sample
from inference_service.engine.scheduler import ScheduledChunk, Scheduler
from inference_service.engine.sequence import Sequence, Status
from inference_service.engine.slots import SlotPool
from inference_service.engine.tokenizer import Tokenizer
from inference_service.model.forward_batch import SequenceInput
from inference_service.sampling import SamplingParams
from shared.errors import FailedPrecondition, InvalidArgument, LoramuxError, NotFound, Unavailable
from shared.model_config import ModelConfig
from shared.names import check_adapter_id
from shared.peft_checkpoint import load_peft_adapter

__all__ = ["AdapterState", "Delta", "Engine", "EngineConfig", "Request", "RequestOutput"]

log = logging.getLogger(__name__)
CAUSE_CHARS = 300  # of an exception's text quoted to a client: enough to name it, never a dump


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    adapter: str | None = None  # a registered adapter name; None = base model
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class Delta:
    """What one step added to one request. The last delta has finish_reason set (and usage);
    a request that failed ends with `error` instead of tokens."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: LoramuxError | None = None


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs]
    error: LoramuxError | None = None

    @classmethod
    def collect(cls, deltas: list[Delta]) -> "RequestOutput":
        last = deltas[-1]
        return cls(
            last.request_id,
            [t for d in deltas for t in d.token_ids],
            "".join(d.text for d in deltas),
            last.finish_reason,
            last.prompt_tokens,
            last.completion_tokens,
            [lp for d in deltas for lp in d.logprobs],
            last.error,
        )


@dataclass(frozen=True, order=True)
class AdapterState:
    name: str
    digest: str  # empty while loading
    location: str  # "device" | "host" | "loading"
    pinned: bool


@dataclass(eq=False)
class _Tracked:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    sink: Callable[[Delta], None]


class Engine:
    def __init__(self, config: EngineConfig, loader: AdapterLoader | None = None):
        self.config = config
        self.runner = ModelRunner(config)
        has_tokenizer = (Path(config.model) / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(config.model) if has_tokenizer else None
        self.loader = loader or LocalAdapterLoader(
            self.runner.model_config, config.max_lora_rank, config.torch_dtype
        )
        self._wakeup = threading.Event()  # set when a step has something new: a submit, a load
        pinned = self.runner.device.type == "cuda"
        self.host = HostTier(config.max_cpu_loras, self.loader, pinned, self._wakeup.set)
        self.slots = SlotPool(config.max_loras)
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.block_size,
            BlockAllocator(self.runner.cache.num_blocks),
            self.slots,
            self.host,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.RLock()  # held by a step, and by adapter changes and snapshots
        self._inbox: deque[Callable[[], None]] = deque()  # submits and aborts, for the next step
        # submitted and not finished, by request id: what a dead engine must still answer
        self._in_flight: dict[str, _Tracked] = {}
        self._ids_lock = threading.Lock()
        self._step_started: float | None = None  # monotonic time the step in progress began
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._fatal: Unavailable | None = None  # set once the engine died or was given up on
        self._on_fatal: list[Callable[[Unavailable], None]] = []
        self.metrics = EngineMetrics()

    # --- adapters -------------------------------------------------------------------------

    def add_adapter(self, name: str, peft_dir: str | Path) -> str:
        """Validate and optimize a local PEFT adapter and put it in the host tier; returns its
        content digest. Re-adding a name replaces its weights for new requests."""
        check_adapter_id(name)
        if not isinstance(self.loader, LocalAdapterLoader):
            raise FailedPrecondition(f"adapter {name!r}: this engine's adapters come from the adapter store")
        weights = load_peft_adapter(
            name, peft_dir, self.runner.model_config, self.config.max_lora_rank, self.config.torch_dtype
        )
        ready = ReadyAdapter.of(name, weights)
        with self._lock:
            self.loader.register(name, peft_dir)
            self.host.remove(name)
            self.host.put(ready)
        return ready.digest

    def remove_adapter(self, name: str, missing_ok: bool = False) -> None:
        """New requests for `name` get NotFound; running ones finish on the weights they have."""
        with self._lock:
            if not missing_ok:
                self._require_adapter(name)
            self.loader.unregister(name)
            self.host.remove(name)

    def pin_adapter(self, name: str) -> None:
        with self._lock:
            self._require_adapter(name)
            self.host.pin(name)

    def unpin_adapter(self, name: str) -> None:
        with self._lock:
            self._require_adapter(name)
            self.host.unpin(name)

    def is_pinned(self, name: str) -> bool:
        with self._lock:
            return self.host.is_pinned(name)

    def held_digests(self) -> dict[str, str]:
        """Adapter name -> digest of every adapter ready in host memory."""
        with self._lock:
            return {name: digest for name, digest, _ in self.host.held() if digest is not None}

    def adapter_states(self) -> list[AdapterState]:
        """Every adapter held: in a device slot, in host memory, or loading; by name."""
        with self._lock:
            return sorted(
                AdapterState(name, digest or "", self._location(digest), pinned)
                for name, digest, pinned in self.host.held()
            )

    def _location(self, digest: str | None) -> str:
        if digest is None:
            return "loading"
        return "device" if self.slots.resident(digest) is not None else "host"

    def _require_adapter(self, name: str) -> None:
        if name not in self.loader:
            raise NotFound(f"adapter {name!r} is not registered")

    # --- requests -------------------------------------------------------------------------

    def submit(self, request: Request, sink: Callable[[Delta], None]) -> None:
        """Queue a request; `sink` receives its deltas from the stepping thread."""
        seq = self._sequence(request)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.stop
            )
        if request.adapter is not None:
            self._require_adapter(request.adapter)
        with self._ids_lock:  # a submit either lands before the engine dies or sees it dead
            if self._fatal is not None:
                raise self._fatal
            if request.request_id in self._in_flight:
                raise InvalidArgument(f"request id {request.request_id!r} is already in flight")
            tracked = self._in_flight[request.request_id] = _Tracked(seq, detokenizer, sink)
            self._post(lambda: self._admit(tracked))

    def abort(self, request_id: str) -> None:
        """Finish the request at the next step: its KV blocks and slot reference are freed then."""
        self._post(lambda: self._abort_now(request_id))

    def abort_all(self) -> None:
        self._post(lambda: [self._finish(t, "abort") for t in list(self._tracked.values())])

    def _post(self, action: Callable[[], None]) -> None:
        self._inbox.append(action)
        self._wakeup.set()

    def _admit(self, tracked: _Tracked) -> None:
        self._tracked[tracked.seq.request_id] = tracked
        self.scheduler.add(tracked.seq)

    def _abort_now(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            self._finish(tracked, "abort")

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run the requests to completion in this thread; outputs in request order."""
        if self._thread is not None:
            raise RuntimeError("generate() drives steps itself; use stream() while the engine thread runs")
        deltas: dict[str, list[Delta]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.submit(r, deltas[r.request_id].append)
        while any(not d or d[-1].finish_reason is None for d in deltas.values()):
            self.step()
        return [RequestOutput.collect(deltas[r.request_id]) for r in requests]

    async def stream(self, request: Request) -> AsyncIterator[Delta]:
        """Deltas of one request as they are produced; closing the iterator aborts it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()

        def deliver(delta: Delta) -> None:
            with contextlib.suppress(RuntimeError):  # the consumer's loop closed: nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, delta)

        self.submit(request, deliver)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.abort(request.request_id)

    # --- the engine thread ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch_steps, name="engine-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.host.close()

    def on_fatal(self, callback: Callable[[Unavailable], None]) -> None:
        """`callback(error)` runs once if the engine thread dies (at once if it already has)."""
        with self._ids_lock:
            self._on_fatal.append(callback)
            dead = self._fatal
        if dead is not None:
            callback(dead)

    def _run(self) -> None:
        try:
            while not self._stopping and self._fatal is None:
                if self.has_work:
                    self.step()
                else:
                    self._wakeup.wait()
                    self._wakeup.clear()  # has_work is checked again before sleeping
        except Exception as e:
            log.exception("the engine failed; ending every request with UNAVAILABLE")
            self._die(Unavailable(f"the worker's engine failed ({_brief(e)}); retry on another worker"))

    def _watch_steps(self) -> None:
        """Gives up on the engine when one step runs past step_timeout_s."""
        limit = self.config.step_timeout_s
        while not self._stopping and self._fatal is None:
            time.sleep(min(1.0, limit / 4))
            started = self._step_started
            if started is not None and time.monotonic() - started > limit:
                log.error("an engine step has run for over %g s; giving up on the engine", limit)
                self._die(Unavailable(f"the worker's engine failed (a step ran past {limit:g} s); retry"))

    def _die(self, error: Unavailable) -> None:
        """Refuse new requests, then end every request already submitted with `error`. Takes no
        step lock: a step that hangs may hold it for good."""
        with self._ids_lock:
            if self._fatal is not None:
                return
            self._fatal = error
            doomed, self._in_flight = list(self._in_flight.values()), {}
            callbacks = list(self._on_fatal)  # a callback added from now on runs at once instead
        for tracked in doomed:
            seq = tracked.seq
            prompt, output = len(seq.prompt_token_ids), len(seq.output_token_ids)
            tracked.sink(Delta(seq.request_id, [], "", [], "error", prompt, output, error))
        for callback in callbacks:
            callback(error)

    def stats(self) -> EngineStats:
        """A snapshot of every counter and gauge, for export."""
        with self._lock:
            m = self.metrics
            return EngineStats(
                dict(m.requests),
                m.prompt_tokens,
                m.generation_tokens,
                m.adapter_load_seconds.copy(),
                self.host.stats(),
                self.slots.stats(),
                self.scheduler.stats(),
            )

    @property
    def model_config(self) -> ModelConfig:
        """The served model's architecture, as its config.json gives it."""
        return self.runner.model_config

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt plus output) one request may hold: the worker's limit or the model's."""
        return min(self.config.max_model_len, self.runner.model_config.max_position_embeddings)

    @property
    def has_work(self) -> bool:
        """Requests to run, or loads to install (a preloaded adapter lands without a request)."""
        return bool(self._inbox or self.scheduler.waiting or self.scheduler.running or self.host.loading)

    # --- one step -------------------------------------------------------------------------

    def step(self) -> None:
        self._step_started = time.monotonic()
        try:
            with self._lock:
                ran = self._step_locked()
        finally:
            self._step_started = None
        if not ran and self.host.loading:
            self._wakeup.wait(0.005)  # only loads are pending: wait for one, or for a submit
            self._wakeup.clear()

    def _step_locked(self) -> bool:
        """One step; False when nothing could be scheduled."""
        while self._inbox:
            self._inbox.popleft()()
        self._collect_loads()
        schedule = self.scheduler.schedule()
        if not schedule.chunks:
            return False
        for slot, ready in schedule.activations:
            self._activate(slot, ready)
        chunks = [c for c in schedule.chunks if c.seq.status is Status.RUNNING]
        if not chunks:
            return True
        chunks.sort(key=lambda c: c.seq.slot)  # grouped by slot for LoRA
        logits = self.runner.forward([_input(c) for c in chunks])  # [chunks, vocab]
        chunks, logits = self._drop_non_finite(chunks, logits)
        rows = [i for i, c in enumerate(chunks) if c.samples]
        seqs = [chunks[i].seq for i in rows]
        result = self._sample(seqs, logits[rows]) if rows else SampleResult([], [])
        self.scheduler.postprocess(chunks, list(zip(seqs, result.token_ids, strict=True)))
        for seq, token, logprobs in zip(seqs, result.token_ids, result.logprobs, strict=True):
            self._emit(self._tracked[seq.request_id], token, logprobs)
        return True

    def _activate(self, slot: int, ready: ReadyAdapter) -> None:
        """Copy an adapter into its slot. Weights the slot cannot take fail only the requests for
        that adapter; it leaves the slot and the host tier (a later request loads it anew)."""
        try:
            self.runner.load_slot(slot, ready.weights)
        except Exception as e:
            log.exception("adapter %r cannot be loaded into device slot %d", ready.name, slot)
            error = FailedPrecondition(
                f"adapter {ready.name!r} cannot be loaded into a device slot: {_brief(e)}"
            )
            for tracked in list(self._tracked.values()):
                seq = tracked.seq
                if seq.slot == slot or (seq.status is Status.WAITING and seq.adapter == ready.name):
                    self._finish(tracked, "error", error)
            self.runner.clear_slot(slot)
            self.slots.vacate(slot)
            self.host.remove(ready.name)

    def _drop_non_finite(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Fail the requests whose logits hold NaN or Inf (weights that overflow in this dtype);
        every chunk is checked, so the K/V any other request can read stay finite."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # [chunks]
        if all(finite):
            return chunks, logits
        for seq in [c.seq for c, ok in zip(chunks, finite, strict=True) if not ok]:
            source = f"adapter {seq.adapter!r}" if seq.adapter else "the base model"
            error = FailedPrecondition(
                f"{source} produced NaN or Inf logits for this request (values overflow in "
                f"{self.config.dtype}); the request was stopped"
            )
            self.runner.clear_blocks(seq.block_table)
            self._finish(self._tracked[seq.request_id], "error", error)
        keep = [i for i, ok in enumerate(finite) if ok]
        return [chunks[i] for i in keep], logits[keep]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SampleResult:
        """One token per sequence from its row of `logits` [seqs, vocab]."""
        # Only penalized rows read their history; building it costs O(length) per row.
        histories = [s.token_ids if s.params.repetition_penalty != 1 else [] for s in seqs]
        batch = SamplingBatch.build(
            [s.params for s in seqs], [s.generator for s in seqs], histories, logits.device
        )
        return sample(logits, batch)

    def _emit(self, tracked: _Tracked, token: int, logprobs: TokenLogprobs | None) -> None:
        """The delta of a token the scheduler has just added to the sequence's output."""
        seq = tracked.seq
        text = tracked.detokenizer.push(token) if tracked.detokenizer else ""
        reason = self._finish_reason(tracked, token)
        tracked.sink(Delta(seq.request_id, [token], text, [logprobs] if logprobs else []))
        if reason is not None:
            self._finish(tracked, reason)

    def _finish_reason(self, tracked: _Tracked, token: int) -> str | None:
        seq, params = tracked.seq, tracked.seq.params
        if tracked.detokenizer is not None and tracked.detokenizer.stopped:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self._eos_ids:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens:
            return "length"
        return None

    @property
    def _eos_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_ids
        return self.runner.model_config.eos_token_ids

    def _finish(self, tracked: _Tracked, reason: str, error: LoramuxError | None = None) -> None:
        seq = tracked.seq
        self.scheduler.finish(seq, reason)
        del self._tracked[seq.request_id]
        with self._ids_lock:
            self._in_flight.pop(seq.request_id, None)
        self.metrics.requests[(seq.adapter or "", reason)] += 1
        self.metrics.prompt_tokens += len(seq.prompt_token_ids)
        self.metrics.generation_tokens += len(seq.output_token_ids)
        tail = tracked.detokenizer.finish() if tracked.detokenizer and reason != "abort" else ""
        tracked.sink(
            Delta(
                seq.request_id,
                [],
                tail,
                [],
                reason,
                len(seq.prompt_token_ids),
                len(seq.output_token_ids),
                error,
            )
        )

    def _collect_loads(self) -> None:
        """Install finished loads. A failed load fails only the waiting requests that named it."""
        seconds, failed = self.host.collect()
        for took in seconds:
            self.metrics.adapter_load_seconds.observe(took)
        for name, error in failed:
            for tracked in list(self._tracked.values()):
                if tracked.seq.adapter == name and tracked.seq.status is Status.WAITING:
                    self._finish(tracked, "error", _as_loramux(error, name))

    def _sequence(self, request: Request) -> Sequence:
        params, prompt = request.params, request.prompt_token_ids
        if not prompt:
            raise InvalidArgument("prompt_token_ids is empty")
        limit = self.max_model_len
        if len(prompt) + params.max_tokens > limit:  # before the scan below, which is O(prompt)
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {limit}"
            )
        vocab = self.runner.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        generator = generator_for(params, self.runner.device)
        seq = Sequence(request.request_id, list(prompt), params, request.adapter, generator=generator)
        self.scheduler.check_fits(seq)
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer; this model folder has no tokenizer.json")
        return seq


def _input(chunk: ScheduledChunk) -> SequenceInput:
    seq = chunk.seq
    tokens = seq.token_ids[seq.num_computed : seq.num_computed + chunk.num_tokens]
    return SequenceInput(tokens, seq.num_computed, seq.block_table, seq.slot)


def _as_loramux(error: Exception, name: str) -> LoramuxError:
    if isinstance(error, LoramuxError):
        return error
    log.error("loading adapter %r failed", name, exc_info=error)
    if isinstance(error, OSError):  # this worker's disk (a full cache), not the adapter
        return Unavailable(
            f"adapter {name!r}: this worker cannot read or write its adapter cache ({_brief(error)})"
        )
    return FailedPrecondition(f"adapter {name!r} could not be loaded: {_brief(error)}")


def _brief(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."

"""The engine against PEFT's own generate, and the behaviour of adapter tiers under pressure."""

import shutil
import threading
import time

import pytest
import torch

from inference_service.adapters.local_loader import LocalAdapterLoader
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.engine.decode_graphs import DecodeGraphs
from inference_service.sampling import SamplingParams
from shared.errors import NotFound
from shared.model_config import ModelConfig

# (adapter, prompt length, max_tokens, step at which it arrives)
WORKLOAD = [
    ("all8", 7, 9, 0),
    (None, 5, 6, 0),
    ("qv4", 11, 12, 0),
    ("mlp16rs", 3, 5, 1),
    ("re2", 8, 10, 2),
    ("pattern", 6, 7, 2),
    (None, 9, 4, 3),
    ("all8", 4, 11, 5),
    ("qv4", 2, 8, 5),
    ("re2", 13, 6, 8),
]


def _prompts(n_tokens: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 160, (n,), generator=gen).tolist() for n in n_tokens]


def _peft_greedy(model_dir, adapter_dirs, adapter, prompt, max_tokens, eos) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dirs[adapter], adapter_name=adapter) if adapter else base
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.fixture(scope="module")
def peft_reference(tiny_models, tiny_adapters):
    """Greedy tokens of every WORKLOAD request, each generated alone by transformers + PEFT."""
    prompts = _prompts([n for _, n, _, _ in WORKLOAD])
    return prompts, [
        _peft_greedy(tiny_models["llama"], tiny_adapters["llama"], adapter, prompt, max_tokens, eos=2)
        for (adapter, _, max_tokens, _), prompt in zip(WORKLOAD, prompts, strict=True)
    ]


def _engine(tiny_models, tiny_adapters, loader=None, **config) -> Engine:
    config = {"max_loras": 4, "max_cpu_loras": 8, "kv_cache_tokens": 1024, "block_size": 4, **config}
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), **config), loader)
    for name, folder in tiny_adapters["llama"].items():
        engine.add_adapter(name, folder)
    return engine


def _run_staggered(engine: Engine, prompts, max_steps: int = 1000) -> dict[str, list[int]]:
    """Submit each request at its arrival step, then step until all finish (a few hundred steps;
    an engine that never finishes them fails at `max_steps`)."""
    outputs: dict[str, list] = {}
    step = 0
    while step <= max(a for *_, a in WORKLOAD) or engine.has_work:
        assert step < max_steps, f"requests still unfinished after {max_steps} steps"
        for i, (adapter, _, max_tokens, arrival) in enumerate(WORKLOAD):
            if arrival == step:
                outputs[str(i)] = []
                request = Request(
                    prompts[i],
                    adapter,
                    SamplingParams(max_tokens=max_tokens, temperature=0),
                    request_id=str(i),
                )
                engine.submit(request, outputs[str(i)].append)
        engine.step()
        step += 1
    return {rid: [t for d in deltas for t in d.token_ids] for rid, deltas in outputs.items()}


# max_cpu_loras 0: an adapter stays in host memory only until its waiting requests are admitted
@pytest.mark.parametrize(("max_loras", "max_cpu_loras"), [(4, 8), (2, 2), (1, 1), (1, 0)])
def test_staggered_mixed_adapters_equal_peft_alone(
    tiny_models, tiny_adapters, peft_reference, max_loras, max_cpu_loras
):
    prompts, expected = peft_reference
    engine = _engine(
        tiny_models,
        tiny_adapters,
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        max_num_batched_tokens=16,
    )
    got = _run_staggered(engine, prompts)
    for i, tokens in enumerate(expected):
        assert got[str(i)] == tokens, f"request {i} ({WORKLOAD[i][0]})"
    if max_loras == 1:  # the memory of one rank-16 adapter: the adapters in flight take turns in it
        assert engine.memory.stats().evictions > 0
    _assert_idle(engine)


def test_decode_steps_from_the_static_graph_buffers_equal_peft(tiny_models, tiny_adapters, peft_reference):
    """The CUDA-graph decode path without the capture: every decode step refills the static
    buffers and runs the bucket's batch through the Triton kernels (in the interpreter here), with
    padding rows, buckets of several sizes, and adapters swapping in two slots between steps."""
    prompts, expected = peft_reference
    engine = _engine(tiny_models, tiny_adapters, max_loras=2, max_num_seqs=6, max_num_batched_tokens=16)
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.cache, runner.decode_buffers(), capture=False)
    assert runner.graphs.buckets == [1, 2, 4, 6]
    got = _run_staggered(engine, prompts)
    for i, tokens in enumerate(expected):
        assert got[str(i)] == tokens, f"request {i} ({WORKLOAD[i][0]})"
    _assert_idle(engine)


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_decode_with_adapters_swapping(
    tiny_models, tiny_adapters, peft_reference
):
    prompts, _ = peft_reference
    runs = {}
    for graphs in (False, True):
        engine = _engine(tiny_models, tiny_adapters, device="cuda", max_loras=2, cuda_graphs=graphs)
        assert (engine.runner.graphs is not None) == graphs
        runs[graphs] = _run_staggered(engine, prompts)
    assert runs[True] == runs[False]


@pytest.mark.gpu
def test_engine_on_cuda_equals_peft_and_keeps_host_adapters_pinned(
    tiny_models, tiny_adapters, peft_reference
):
    prompts, expected = peft_reference
    engine = _engine(tiny_models, tiny_adapters, device="cuda", max_loras=2, max_num_batched_tokens=16)
    got = _run_staggered(engine, prompts)
    for i, tokens in enumerate(expected):
        assert got[str(i)] == tokens, f"request {i} ({WORKLOAD[i][0]})"
    ready = [engine.host.get(name) for name in tiny_adapters["llama"]]
    # an empty part (a target the adapter leaves alone, no vocabulary side) holds no memory to pin
    assert all(pages.is_pinned() for r in ready for pages in r.image.pages if pages.numel())
    assert sum(pages.numel() for r in ready for pages in r.image.pages) > 0
    _assert_idle(engine)


def _assert_idle(engine: Engine) -> None:
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.scheduler.stats().kv_blocks_used == 0
    assert engine.memory.active == 0


def test_waiting_adapter_is_not_starved_by_a_stream_of_resident_requests(tiny_models, tiny_adapters):
    engine = _engine(tiny_models, tiny_adapters, max_loras=1, max_num_seqs=8)
    finished: dict[str, int] = {}

    def submit(rid, adapter):
        def sink(delta):
            if delta.finish_reason:
                finished[rid] = step

        engine.submit(
            Request(
                [5, 6, 7],
                adapter,
                SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                request_id=rid,
            ),
            sink,
        )

    step = 0
    submit("a0", "all8")
    engine.step()
    submit("b", "qv4")
    for step in range(1, 60):  # a new request for the resident adapter every step
        submit(f"a{step}", "all8")
        engine.step()
        if "b" in finished:
            break
    assert "b" in finished and finished["b"] < 20


class GatedLoader(LocalAdapterLoader):
    """Counts loads; each one waits until the test opens the gate, as a slow fetch would."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list[str] = []
        self.gate = threading.Event()

    def load(self, name, digest=None):
        self.calls.append(name)
        self.gate.wait(timeout=30)
        return super().load(name, digest)


def _gated_loader(tiny_models) -> GatedLoader:
    return GatedLoader(ModelConfig.from_dir(tiny_models["llama"]), 16, torch.float32)


def test_many_requests_for_a_cold_adapter_load_it_once_and_others_keep_decoding(tiny_models, tiny_adapters):
    loader = _gated_loader(tiny_models)
    engine = _engine(tiny_models, tiny_adapters, loader, max_cpu_loras=1)  # only "pattern" stays hot
    base_deltas: list = []
    engine.submit(
        Request([4, 5, 6], None, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
        base_deltas.append,
    )
    cold = [Request([7, 8], "all8", SamplingParams(max_tokens=3, temperature=0)) for _ in range(10)]
    outputs = {r.request_id: [] for r in cold}
    for r in cold:
        engine.submit(r, outputs[r.request_id].append)
    for _ in range(10):  # the load is held; the base request must keep decoding meanwhile
        engine.step()
    assert len(base_deltas) == 10 and all(not d for d in outputs.values())
    loader.gate.set()
    while engine.has_work:
        engine.step()
    assert loader.calls == ["all8"]
    assert all(d[-1].finish_reason in ("length", "stop") for d in outputs.values())
    _assert_idle(engine)


def test_failed_load_fails_only_its_requests(tiny_models, tiny_adapters, tmp_path):
    broken = shutil.copytree(tiny_adapters["llama"]["qv4"], tmp_path / "broken")
    engine = _engine(tiny_models, tiny_adapters, max_cpu_loras=1)
    engine.add_adapter("broken", broken)
    engine.add_adapter("evictor", tiny_adapters["llama"]["re2"])  # pushes "broken" out of the host tier
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    outputs = engine.generate(
        [
            Request([3, 4, 5], "broken", SamplingParams(max_tokens=4)),
            Request([3, 4, 5], "all8", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)),
            Request([3, 4, 5], None, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)),
        ]
    )
    assert outputs[0].finish_reason == "error" and "not a readable safetensors file" in str(outputs[0].error)
    assert [o.finish_reason for o in outputs[1:]] == ["length", "length"]
    assert [len(o.token_ids) for o in outputs[1:]] == [4, 4]
    _assert_idle(engine)


def test_abort_frees_kv_blocks_and_slots_within_one_step(tiny_models, tiny_adapters):
    engine = _engine(tiny_models, tiny_adapters)
    deltas: dict[str, list] = {}
    for i, adapter in enumerate(["all8", "qv4", None, "re2"]):
        deltas[str(i)] = []
        engine.submit(
            Request([3] * 10, adapter, SamplingParams(max_tokens=50, ignore_eos=True), str(i)),
            deltas[str(i)].append,
        )
    for _ in range(3):
        engine.step()
    assert engine.memory.active == 3 and len(engine.scheduler.running) == 4
    for rid in deltas:
        engine.abort(rid)
    engine.step()
    _assert_idle(engine)
    assert all(d[-1].finish_reason == "abort" for d in deltas.values())


def test_seeded_request_gives_the_same_tokens_whatever_the_batch(tiny_models, tiny_adapters):
    engine = _engine(tiny_models, tiny_adapters)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    seeded = Request([9, 8, 7, 6], "all8", params)
    alone = engine.generate([seeded])[0].token_ids
    crowd = [
        Request([5 + i] * (i + 2), a, SamplingParams(max_tokens=8, temperature=1.0))
        for i, a in enumerate(["qv4", None, "all8", "re2"])
    ]
    crowded = engine.generate([*crowd[:2], Request(seeded.prompt_token_ids, "all8", params), *crowd[2:]])[2]
    assert crowded.token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert engine.generate([Request([9, 8, 7, 6], "all8", other_seed)])[0].token_ids != alone


def test_removed_adapter_refuses_new_requests_while_running_ones_finish(tiny_models, tiny_adapters):
    engine = _engine(tiny_models, tiny_adapters)
    deltas: list = []
    engine.submit(Request([3, 4], "qv4", SamplingParams(max_tokens=6, ignore_eos=True)), deltas.append)
    engine.step()
    engine.remove_adapter("qv4")
    with pytest.raises(NotFound, match="adapter 'qv4' is not registered"):
        engine.submit(Request([3, 4], "qv4"), print)
    while engine.has_work:
        engine.step()
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 6


class _LockStep:
    """Holds each of an engine's steps after the first until the consumer has taken the last
    delta, so the consumer keeps up by construction rather than by timing."""

    def __init__(self, engine):
        self._engine, self._run = engine, engine.runner.run
        self._taken = threading.Semaphore(0)
        self._first = True
        engine.runner.run = self._gated

    def took(self) -> None:
        self._taken.release()

    def end(self) -> None:
        self._engine.runner.run = self._run

    def _gated(self, chunks):
        if not self._first and not self._taken.acquire(timeout=5):
            raise TimeoutError("the consumer took no delta in 5 s")
        self._first = False
        return self._run(chunks)


def test_generate_hands_on_delta_each_delta_as_its_step_ends(tiny_models, tiny_adapters):
    """What bench.peers times decode by: deltas in each request's order, as the steps make them,
    not collected at the end."""
    engine = _engine(tiny_models, tiny_adapters)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    requests = [
        Request(p, a, params) for p, a in zip(_prompts([4, 6, 3]), [None, "all8", "qv4"], strict=True)
    ]
    runs, seen = [], []  # seen: (the model runs so far, a delta)
    run = engine.runner.run
    engine.runner.run = lambda chunks: (runs.append(1), run(chunks))[1]
    outputs = engine.generate(requests, on_delta=lambda d: seen.append((len(runs), d)))
    for request, output in zip(requests, outputs, strict=True):
        mine = [(step, d) for step, d in seen if d.request_id == request.request_id]
        assert [t for _, d in mine for t in d.token_ids] == output.token_ids and len(output.token_ids) == 5
        assert mine[-1][1].finish_reason == "length" and all(d.finish_reason is None for _, d in mine[:-1])
        tokens_at = [step for step, d in mine if d.token_ids]
        assert tokens_at == sorted(set(tokens_at))  # one token a step, handed over as that step ended


def test_stream_yields_deltas_and_closing_it_aborts(tiny_models, tiny_adapters):
    import asyncio

    engine = _engine(tiny_models, tiny_adapters)
    lock_step = _LockStep(engine)
    engine.start()

    async def scenario():
        full = []
        async for d in engine.stream(Request([3, 4], "all8", SamplingParams(max_tokens=5, ignore_eos=True))):
            full.append(d)
            lock_step.took()
        stream = engine.stream(Request([3, 4], "qv4", SamplingParams(max_tokens=200, ignore_eos=True)))
        first = await stream.__anext__()
        await stream.aclose()
        lock_step.end()
        lock_step.took()  # lets the step held since the first delta run, with the abort queued
        return full, first

    try:
        full, first = asyncio.run(scenario())
        # one delta per step while the consumer keeps up; the last token and the finish may come joined
        assert [len(d.token_ids) for d in full][:4] == [1, 1, 1, 1] and full[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in full) == 5 and all(d.finish_reason is None for d in full[:-1])
        assert len(first.token_ids) == 1
        deadline = time.monotonic() + 5
        while engine.has_work and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_work
    finally:
        engine.stop()


def test_a_stream_that_falls_behind_catches_up_in_one_delta_with_every_token(tiny_models, tiny_adapters):
    import asyncio

    engine = _engine(tiny_models, tiny_adapters)
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2)
    expected = engine.generate([Request([3, 4], "all8", params)])[0]
    first_taken, run, steps = threading.Event(), engine.runner.run, []

    def second_step_waits_for_the_first_delta(chunks):
        steps.append(None)
        if len(steps) == 2 and not first_taken.wait(timeout=5):
            raise TimeoutError("the consumer took no first delta in 5 s")
        return run(chunks)

    engine.runner.run = second_step_waits_for_the_first_delta
    engine.start()

    async def scenario():
        stream = engine.stream(Request([3, 4], "all8", params))
        first = await stream.__anext__()
        first_taken.set()
        deadline = time.monotonic() + 5
        while engine.has_work and time.monotonic() < deadline:
            time.sleep(0.01)  # the consumer's loop is busy: every later delta waits for it
        return [first] + [d async for d in stream]

    try:
        deltas = asyncio.run(scenario())
    finally:
        engine.stop()
    assert [len(d.token_ids) for d in deltas] == [1, 6]  # the six it missed, in one delta
    assert (
        deltas[1].token_ids == expected.token_ids[1:]
        and deltas[1].text == expected.text[len(deltas[0].text) :]
    )
    assert [lp for d in deltas for lp in d.logprobs] == expected.logprobs
    assert (deltas[-1].finish_reason, deltas[-1].completion_tokens) == ("length", 7)


def test_stats_count_requests_tokens_tiers_and_loads(tiny_models, tiny_adapters):
    engine = _engine(tiny_models, tiny_adapters, max_loras=1, max_cpu_loras=2)  # "re2", "pattern" stay hot
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.generate(
        [Request([3, 4], "all8", params), Request([3, 4], "qv4", params), Request([5], None, params)]
    )
    stats = engine.stats()
    assert stats.requests == {("all8", "length"): 1, ("qv4", "length"): 1, ("", "length"): 1}
    assert (stats.prompt_tokens, stats.generation_tokens) == (5, 9)
    assert stats.host_tier.misses == 2 and stats.adapter_load_seconds.count == 2
    assert (stats.host_tier.request_hits, stats.host_tier.request_misses) == (0, 2)
    # all8 (rank 8 on every module) and qv4 (rank 4 on q, v) both fit where one rank-16 adapter did
    assert (stats.slots.activations, stats.slots.evictions, stats.slots.active) == (2, 0, 0)
    assert 0 < stats.slots.bytes_used < stats.slots.bytes_total
    assert (stats.scheduler.waiting, stats.scheduler.running) == (0, 0)
    engine.generate([Request([3, 4], "qv4", params)])  # still in the host tier
    assert (engine.stats().host_tier.request_hits, engine.stats().host_tier.request_misses) == (1, 2)


def test_pinned_adapter_stays_in_the_host_tier_under_pressure(tiny_models, tiny_adapters):
    loader = _gated_loader(tiny_models)
    loader.gate.set()
    engine = Engine(
        EngineConfig(model=str(tiny_models["llama"]), max_cpu_loras=1, kv_cache_tokens=256), loader
    )
    engine.add_adapter("all8", tiny_adapters["llama"]["all8"])
    engine.pin_adapter("all8")
    for name in ("qv4", "re2", "pattern"):  # each evicts the previous unpinned one
        engine.add_adapter(name, tiny_adapters["llama"][name])
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.generate([Request([3, 4], "all8", params), Request([3, 4], "pattern", params)])
    assert loader.calls == []  # both served from the host tier
    engine.unpin_adapter("all8")
    engine.generate([Request([3, 4], "qv4", params)])
    engine.generate([Request([3, 4], "all8", params)])
    assert loader.calls == ["qv4", "all8"]  # unpinned, it left the tier like any other


def test_adapter_changes_and_snapshots_never_wait_for_a_step(tiny_models, tiny_adapters, monkeypatch):
    """What the store watch, GetStats, /metrics and ListAdapters call returns while a step runs
    (held open here: a hung device, or a step starved of CPU); the changes apply before the next
    step, and a removed adapter is refused at once."""
    engine = _engine(tiny_models, tiny_adapters)
    forward, entered, release = engine.runner.forward, threading.Event(), threading.Event()

    def held_forward(*args, **kwargs):
        entered.set()
        release.wait(60)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", held_forward)
    finished = threading.Event()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.submit(Request([5, 6, 7], "all8", params), lambda d: d.finish_reason and finished.set())
    engine.start()
    try:
        assert entered.wait(30)
        calls = [
            engine.stats,
            engine.adapter_states,
            engine.held_digests,
            lambda: engine.pin_adapter("qv4"),
            lambda: engine.unpin_adapter("pattern"),
            lambda: engine.remove_adapter("re2"),
        ]
        caller = threading.Thread(target=lambda: [call() for call in calls])
        caller.start()
        caller.join(timeout=30)
        assert not caller.is_alive(), "a call waited for the step held open"
        assert entered.is_set() and not release.is_set()  # all of them answered during the step
        with pytest.raises(NotFound):
            engine.submit(Request([5], "re2", params), lambda d: None)
    finally:
        release.set()
    assert finished.wait(30)
    deadline = time.monotonic() + 30
    while "re2" in engine.held_digests():  # the next step's snapshot
        assert time.monotonic() < deadline
        time.sleep(0.01)
    states = {s.name: s for s in engine.adapter_states()}
    assert states["qv4"].pinned and not states["pattern"].pinned
    engine.stop()


# --- KV memory: preemption and the prefix cache -------------------------------------------------


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_requests_preempted_and_resumed_give_the_tokens_they_give_alone(
    tiny_models, tiny_adapters, peft_reference, caching
):
    """A KV cache of 12 blocks of 4 for up to 10 requests of up to 25 positions: running
    requests outgrow it, the newest give their blocks back and are computed again later (without
    the prefix cache, in several chunks of at most 6 tokens)."""
    prompts, expected = peft_reference
    engine = _engine(
        tiny_models,
        tiny_adapters,
        kv_cache_tokens=48,
        max_model_len=32,
        max_num_batched_tokens=6,
        prefix_caching=caching,
    )
    got = _run_staggered(engine, prompts)
    for i, tokens in enumerate(expected):
        assert got[str(i)] == tokens, f"request {i} ({WORKLOAD[i][0]})"
    assert engine.scheduler.stats().preemptions > 0
    _assert_idle(engine)


def _system_prompted(prompts: list[list[int]]) -> list[Request]:
    """WORKLOAD's requests, each after a 14-token system prompt of its adapter's own."""
    system = {adapter: [150 - len(str(adapter)) - k for k in range(14)] for adapter, *_ in WORKLOAD}
    return [
        Request(system[adapter] + prompt, adapter, SamplingParams(max_tokens=max_tokens, temperature=0))
        for (adapter, _, max_tokens, _), prompt in zip(WORKLOAD, prompts, strict=True)
    ]


def test_prefix_caching_changes_no_token(tiny_models, tiny_adapters, peft_reference):
    prompts, _ = peft_reference
    outputs = {}
    for caching in (True, False):
        engine = _engine(tiny_models, tiny_adapters, prefix_caching=caching)
        first = engine.generate(_system_prompted(prompts))
        again = engine.generate(_system_prompted(prompts))  # the system prompts are cached now
        outputs[caching] = ([o.token_ids for o in first], [o.token_ids for o in again])
        if caching:
            assert all(o.cached_tokens >= 12 for o in again)  # 14 + >= 2 tokens: 3 blocks of 4 at least
            assert engine.stats().scheduler.prefix_cache_hits > 0
        else:
            assert all(o.cached_tokens == 0 for o in first + again)
    assert outputs[True] == outputs[False]


def test_the_same_prompt_under_other_weights_is_computed_afresh(tiny_models, tiny_adapters):
    prompt = list(range(20, 40))
    params = SamplingParams(max_tokens=6, temperature=0)
    engine = _engine(tiny_models, tiny_adapters)

    def run(adapter: str | None):
        (out,) = engine.generate([Request(prompt, adapter, params)])
        return out

    first = run("all8")
    assert (first.cached_tokens, run("all8").cached_tokens) == (0, 16)  # hits under the same weights
    assert run("qv4").cached_tokens == 0 and run(None).cached_tokens == 0
    engine.add_adapter("all8", tiny_adapters["llama"]["pattern"])  # the name, re-registered
    renamed = run("all8")
    fresh = _engine(tiny_models, tiny_adapters)
    fresh.add_adapter("all8", tiny_adapters["llama"]["pattern"])
    (expected,) = fresh.generate([Request(prompt, "all8", params)])
    assert renamed.cached_tokens == 0 and renamed.token_ids == expected.token_ids != first.token_ids

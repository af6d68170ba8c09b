"""An engine over several tensor-parallel ranks (EngineConfig.tensor_parallel_size): rank 0 is
this process, the others are processes it starts. Its greedy tokens equal transformers + PEFT's
for every request alone, through preemption, the prefix cache, adapters evicted from adapter
memory and host memory and loaded again, and an adapter re-registered mid-stream. A rank that
dies or hangs ends every stream with Unavailable and leaves no process behind; one that dies as
it starts fails the engine's start, naming it."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from inference_service.torch_threads import crowding, per_rank
from shared.errors import Unavailable
from tests.inference_service.engine.test_adapter_versions import PROMPTS, _alone, _run_until_running
from tests.inference_service.engine.test_engine import _engine, _run_staggered, peft_reference  # noqa: F401

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


# adapter memory for max_loras rank-16 adapters on every module, so that adapters are evicted
# and requests preempted either way (a fully sharded rank's part of one is smaller)
@pytest.mark.parametrize(
    ("size", "fully_sharded", "max_loras"),
    [(2, False, 1), (4, False, 1), (2, True, 2)],
    ids=["2", "4", "2-fully-sharded"],
)
def test_ranks_give_pefts_tokens_through_preemption_eviction_and_reloads(
    size,
    fully_sharded,
    max_loras,
    tiny_models,
    tiny_adapters,
    peft_reference,  # noqa: F811 - test_engine's fixture
):
    """test_engine's staggered workload in a 48-position KV cache (requests outgrow it and are
    computed again), adapter memory for a few of its 5 adapters, host memory for 2: every rank
    loads, evicts and reloads its part of each adapter as rank 0 says."""
    prompts, expected = peft_reference
    engine = _engine(
        tiny_models,
        tiny_adapters,
        tensor_parallel_size=size,
        fully_sharded_loras=fully_sharded,
        kv_cache_tokens=48,
        max_model_len=32,
        max_num_batched_tokens=6,
        max_loras=max_loras,
        max_cpu_loras=2,
    )
    try:
        got = _run_staggered(engine, prompts)
        stats = engine.stats()
    finally:
        engine.stop()
    for i, tokens in enumerate(expected):
        assert got[str(i)] == tokens, f"request {i}"
    assert stats.scheduler.preemptions > 0 and stats.slots.evictions > 0 and stats.host_tier.evictions > 0


def test_a_preempted_request_keeps_its_adapters_old_content_on_every_rank(tiny_models, tiny_adapters):
    """Re-registered while its requests run, with no host memory to keep the old content: the
    preempted request is computed again from the old content's blob on every rank."""
    model, folders = tiny_models["llama"], tiny_adapters["llama"]
    config = EngineConfig(
        model=str(model),
        tensor_parallel_size=2,
        kv_cache_tokens=48,
        max_model_len=32,
        max_cpu_loras=0,
        block_size=4,
    )
    engine = Engine(config)
    try:
        engine.add_adapter("x", folders["all8"])
        deltas = [[] for _ in PROMPTS]
        for prompt, sink in zip(PROMPTS, deltas, strict=True):
            engine.submit(Request(prompt, "x", GREEDY), sink.append)
        _run_until_running(engine, 2)
        engine.add_adapter("x", folders["pattern"])
        while engine.has_work:
            engine.step()
        preemptions = engine.stats().scheduler.preemptions
    finally:
        engine.stop()
    assert preemptions > 0
    assert [[t for d in ds for t in d.token_ids] for ds in deltas] == _alone(model, folders["all8"], PROMPTS)


def _streaming_engine(tiny_models, **config) -> tuple[Engine, list, threading.Event]:
    """A 2-rank engine running in its thread, one long request streaming into a list."""
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), tensor_parallel_size=2, **config))
    deltas, ended = [], threading.Event()

    def sink(delta):
        deltas.append(delta)
        if delta.finish_reason is not None:
            ended.set()

    engine.start()
    engine.submit(Request([5, 6, 7], None, SamplingParams(max_tokens=200, ignore_eos=True)), sink)
    deadline = time.monotonic() + 30
    while not deltas and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine, deltas, ended


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_ends_every_stream_with_unavailable_and_leaves_no_process(
    tiny_models, fault
):
    engine, deltas, ended = _streaming_engine(tiny_models, step_timeout_s=3.0)
    (pid,) = engine.runner.followers.pids
    fatal = threading.Event()
    engine.on_fatal(lambda _: fatal.set())
    os.kill(pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    try:
        assert ended.wait(timeout=10), "the stream did not end within 10 s"
        assert fatal.wait(timeout=1)
        gone = time.monotonic() + 2  # killed as the engine dies: a stopped process reads no pipe
        while _alive(pid) and time.monotonic() < gone:
            time.sleep(0.01)
        assert not _alive(pid)
    finally:
        engine.stop()
    assert deltas[-1].finish_reason == "error" and isinstance(deltas[-1].error, Unavailable)


def test_ranks_wait_for_the_next_step_however_long_the_engine_sits_idle(tiny_models):
    """Past the step timeout with nothing to do, the ranks are still there to serve."""
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), tensor_parallel_size=2, step_timeout_s=1.0))
    engine.start()
    try:
        time.sleep(2.5)
        deltas = []
        engine.submit(Request([5, 6], None, SamplingParams(max_tokens=4, ignore_eos=True)), deltas.append)
        deadline = time.monotonic() + 10
        while not (deltas and deltas[-1].finish_reason) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert deltas[-1].finish_reason == "length"


def test_generate_steps_over_rank_zeros_share_of_the_cpus_and_leaves_the_callers_threads(tiny_models):
    """generate() steps rank 0 over its share of the CPUs, as its engine thread would (over all
    of them, beside the other ranks' threads, every collective waited on spinning threads), and
    leaves the calling thread's own thread count as it was."""
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), tensor_parallel_size=2))
    threads = []
    engine.runner.model.register_forward_pre_hook(lambda *_: threads.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        out = engine.generate([Request([5, 6], None, SamplingParams(max_tokens=3, ignore_eos=True))])
    finally:
        engine.stop()
    assert len(out[0].token_ids) == 3 and len(threads) >= 3
    assert set(threads) == {per_rank(2)} and torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("ranks", "cpus", "crowded"), [(2, 2, False), (3, 2, True), (4, 16, False), (8, 4, True)]
)
def test_more_ranks_than_cpus_are_named_as_crowding_them(ranks, cpus, crowded, monkeypatch):
    """RankGroup logs it as a warning on the CPU (the three-rank worker test reads it there)."""
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    why = crowding(ranks)
    assert (why is not None) == crowded
    assert not crowded or f"tensor_parallel_size {ranks} on {cpus} CPUs" in why


def test_a_rank_that_dies_as_it_starts_fails_the_engines_start_naming_it(tiny_models):
    """As the kernel's OOM killer would end it while it loads its part of the model."""
    killed = threading.Thread(target=_kill_first_rank, args=(os.getpid(),), daemon=True)
    killed.start()
    with pytest.raises(Unavailable, match=r"tensor-parallel rank 1 failed to start: .*SIGKILL"):
        Engine(EngineConfig(model=str(tiny_models["llama"]), tensor_parallel_size=2))
    killed.join()


def _kill_first_rank(parent: int) -> None:
    """SIGKILL the first rank process `parent` starts, as soon as it runs."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in _children(parent):
            if b"rank_follower" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                return
        time.sleep(0.005)


def _children(parent: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.gpu
def test_two_ranks_on_two_gpus_give_one_gpus_tokens(tiny_models, tiny_adapters):
    """The NCCL path: rank r on cuda:r, the model's exchanges over NCCL, the commands over gloo;
    adapters split with their layers and fully sharded, on the Triton kernels' path."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    requests = [
        Request([5 + i, 6, 7, 8 + i], adapter, GREEDY, f"r{i}")
        for i, adapter in enumerate([None, "all8", "qv4", "mlp16rs", "re2", "pattern"])
    ]
    tokens = {}
    for size, fully_sharded in ((1, False), (2, False), (2, True)):
        engine = _engine(
            tiny_models,
            tiny_adapters,
            device="cuda",
            tensor_parallel_size=size,
            fully_sharded_loras=fully_sharded,
        )
        try:
            tokens[size, fully_sharded] = [out.token_ids for out in engine.generate(requests)]
        finally:
            engine.stop()
    assert tokens[2, False] == tokens[1, False] == tokens[2, True]


def test_ranks_load_vocabulary_side_parts_in_rank_zeros_pages_and_give_one_devices_tokens(tmp_path):
    """Adapters on the embedding and head (LoRA, own copies, re-trained rows: rows of 2 of the 4
    ranks' vocabularies, 40 tokens each), in adapter memory for few at a time: each rank
    places its part of every adapter where rank 0 places its own, through evictions and reloads,
    and the tokens equal the engine's on one device."""
    from tests.conftest import build_tiny_model
    from tests.inference_service.model.test_vocab_reference import KINDS, UNTIED_KINDS, build_vocab_adapter

    model_dir = build_tiny_model(tmp_path / "model", "qwen2", vocab_size=158)
    kinds = KINDS | UNTIED_KINDS
    folders = {
        name: build_vocab_adapter(model_dir, tmp_path / name, i + 1, **lora)
        for i, (name, lora) in enumerate(kinds.items())
    }
    requests = [
        Request([5, 17, 40 + i, 101, 120 - i], name, GREEDY) for i, name in enumerate([*folders, None])
    ]

    def tokens(size: int) -> list[list[int]]:
        config = EngineConfig(model=str(model_dir), tensor_parallel_size=size, max_loras=1, max_cpu_loras=3)
        engine = Engine(config)
        try:
            for name, folder in folders.items():
                engine.add_adapter(name, folder)
            outputs = engine.generate(requests)
            return [o.token_ids for o in outputs], engine.stats()
        finally:
            engine.stop()

    (one, _), (four, stats) = tokens(1), tokens(4)
    assert four == one
    assert stats.slots.evictions > 0 and stats.host_tier.evictions > 0

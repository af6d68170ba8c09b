"""A request keeps the adapter content it was submitted with to its last token: re-registering
or removing the name changes only requests submitted after, through preemption, recompute,
host-tier eviction and reload by digest."""

import shutil

import pytest

from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.errors import NotFound

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]]


def _engine(model, adapters: dict, **config) -> Engine:
    config = {"max_loras": 4, "max_cpu_loras": 8, "kv_cache_tokens": 1024, "block_size": 4, **config}
    engine = Engine(EngineConfig(model=str(model), **config))
    for name, folder in adapters.items():
        engine.add_adapter(name, folder)
    return engine


def _alone(model, folder, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """Each prompt's tokens from an engine that only ever had this adapter, with room to spare."""
    engine = _engine(model, {"x": folder})
    return [engine.generate([Request(p, "x", params)])[0].token_ids for p in prompts]


def _submit(engine: Engine, prompts, adapter: str, params: SamplingParams = GREEDY) -> list[list]:
    deltas = [[] for _ in prompts]
    for prompt, sink in zip(prompts, deltas, strict=True):
        engine.submit(Request(prompt, adapter, params), sink.append)
    return deltas


def _run_until_running(engine: Engine, count: int) -> None:
    """Step until `count` requests run (their adapter's load is asynchronous), then once more."""
    for _ in range(500):
        engine.step()
        if len(engine.scheduler.running) == count:
            engine.step()
            return
    pytest.fail(f"{count} requests not running after 500 steps")


def _drain(engine: Engine) -> None:
    for _ in range(500):
        if not engine.has_work:
            return
        engine.step()
    pytest.fail("requests still unfinished after 500 steps")


def _tokens(deltas: list) -> list[int]:
    assert deltas[-1].finish_reason == "length", deltas[-1].error
    return [t for d in deltas for t in d.token_ids]


# max_cpu_loras 0: the old content leaves host memory once its requests are admitted, so the
# preempted one reloads it by digest from its folder
@pytest.mark.parametrize("max_cpu_loras", [8, 0])
@pytest.mark.parametrize("change", ["re-register", "remove"])
def test_a_preempted_request_finishes_on_the_weights_it_was_submitted_with(
    tiny_models, tiny_adapters, change, max_cpu_loras
):
    """Two 28-position requests in a 48-position cache: the newer is preempted after the change
    and computed again, on the old weights."""
    model, folders = tiny_models["llama"], tiny_adapters["llama"]
    engine = _engine(
        model, {"x": folders["all8"]}, kv_cache_tokens=48, max_model_len=32, max_cpu_loras=max_cpu_loras
    )
    deltas = _submit(engine, PROMPTS, "x")
    _run_until_running(engine, 2)
    if change == "re-register":
        new = engine.add_adapter("x", folders["pattern"])
        later = _submit(engine, PROMPTS[:1], "x")
    else:
        engine.remove_adapter("x")
        with pytest.raises(NotFound, match="adapter 'x' is not registered"):
            engine.submit(Request(PROMPTS[0], "x"), print)
        new, later = None, []
    # listings name the content new requests get, not the one kept for running ones
    assert [s.digest for s in engine.adapter_states()] == ([new] if new and max_cpu_loras else [])
    _drain(engine)

    assert engine.stats().scheduler.preemptions > 0
    assert [_tokens(d) for d in deltas] == _alone(model, folders["all8"], PROMPTS)
    if later:
        assert [_tokens(d) for d in later] == _alone(model, folders["pattern"], PROMPTS[:1])
    # the old content left host memory with its last request
    assert engine.stats().host_tier.size == (1 if change == "re-register" and max_cpu_loras else 0)


def test_a_waiting_request_keeps_the_content_it_was_submitted_with_and_its_cached_prefix(
    tiny_models, tiny_adapters
):
    """The rule: a request is bound to its adapter's content when submitted (not when admitted).
    One waiting for adapter memory while its adapter is re-registered runs on the old weights,
    over the old weights' cached blocks; one submitted after the change gets the new weights
    and none of those blocks."""
    model, folders = tiny_models["llama"], tiny_adapters["llama"]
    # adapter memory for one rank-8 adapter on every module: "x" cannot join "busy"
    engine = _engine(model, {"x": folders["all8"], "busy": folders["qv4"]}, max_loras=1, max_lora_rank=8)
    prompt = list(range(30, 50))  # 4 full blocks usable from the prefix cache
    params = SamplingParams(max_tokens=6, temperature=0)
    old = engine.generate([Request(prompt, "x", params)])[0]
    busy = _submit(engine, [[5, 6, 7]], "busy", SamplingParams(max_tokens=30, ignore_eos=True))
    _run_until_running(engine, 1)
    waiting = _submit(engine, [prompt], "x", params)
    engine.step()  # looked up in the prefix cache, then left waiting for adapter memory
    assert engine.stats().scheduler.waiting_adapters == ("x",)

    engine.add_adapter("x", folders["pattern"])
    after = _submit(engine, [prompt], "x", params)
    _drain(engine)

    assert _tokens(busy[0]) and _tokens(waiting[0]) == old.token_ids
    assert waiting[0][-1].cached_tokens == 16
    assert _tokens(after[0]) == _alone(model, folders["pattern"], [prompt], params)[0]
    assert after[0][-1].cached_tokens == 0


def test_a_folder_changed_under_a_bound_request_fails_it_naming_the_folder(
    tiny_models, tiny_adapters, tmp_path
):
    """The old content is no longer in host memory (max_cpu_loras 0) and its folder now holds
    the new weights: the preempted request cannot be finished as it began, and says so."""
    model, folders = tiny_models["llama"], tiny_adapters["llama"]
    folder = shutil.copytree(folders["all8"], tmp_path / "x")
    engine = _engine(model, {"x": folder}, kv_cache_tokens=48, max_model_len=32, max_cpu_loras=0)
    deltas = _submit(engine, PROMPTS, "x")
    _run_until_running(engine, 2)
    shutil.rmtree(folder)
    shutil.copytree(folders["pattern"], folder)
    engine.add_adapter("x", folder)
    _drain(engine)

    finishes = [d[-1] for d in deltas]
    assert [f.finish_reason for f in finishes] == ["length", "error"]
    assert f"the files in {folder} changed after they were registered" in str(finishes[1].error)

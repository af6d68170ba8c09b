"""Engine faults: what belongs to one adapter or request fails only its requests; anything else
ends every request with UNAVAILABLE and refuses new ones, never leaving a stream waiting."""

import errno
import queue
import shutil
import threading
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference_service.adapters.host_tier import ReadyAdapter
from inference_service.adapters.local_loader import LocalAdapterLoader
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.errors import FailedPrecondition, Unavailable
from shared.model_config import ModelConfig
from shared.peft_checkpoint import AdapterWeights, ModuleLora, load_peft_adapter

GREEDY = dict(temperature=0, ignore_eos=True)


class TamperingLoader(LocalAdapterLoader):
    """Serves registered PEFT folders as they are, plus weights that device memory cannot take,
    as a store that skipped its checks would serve them: the loader builds their images."""

    def __init__(self, model: ModelConfig, tampered: dict[str, AdapterWeights]):
        super().__init__(model, 16, torch.float32)
        self.tampered = tampered

    def __contains__(self, name: str) -> bool:
        return name in self.tampered or super().__contains__(name)

    def load(self, name: str, digest: str | None = None) -> ReadyAdapter:
        if name in self.tampered:
            return ReadyAdapter.of(name, self.tampered[name], self._model, torch.float32)
        return super().load(name, digest)


def _tampered(tiny_models, tiny_adapters) -> dict[str, AdapterWeights]:
    model = ModelConfig.from_dir(tiny_models["llama"])
    good = load_peft_adapter("all8", tiny_adapters["llama"]["all8"], model, 16, torch.float32)
    (layer, module), m = next(iter(good.modules.items()))
    rank32 = ModuleLora(torch.ones(32, m.a.shape[1]), torch.ones(32, m.b_t.shape[1]))
    return {
        # rank-32 tensors in an adapter that declares rank 2, past max_lora_rank 16: refused
        # when activated
        "rank32": replace(good, rank=2, modules={(layer, module): rank32}),
        # a layer the model lacks: refused when loaded, before it reaches the host tier
        "layer-1": replace(good, modules={(-1, module): m}),
    }


REFUSED = {  # what each tampered adapter's requests are told
    "rank32": ("adapter 'rank32' cannot be loaded into device memory: ", "rank 32, above max_lora_rank 16"),
    "layer-1": ("adapter 'layer-1' could not be loaded: ", "layers.-1.", "the model has layers 0..1"),
}


def _engine(tiny_models, tiny_adapters, loader=None, **overrides) -> Engine:
    config = dict(model=str(tiny_models["llama"]), max_loras=2, kv_cache_tokens=1024, block_size=4)
    engine = Engine(EngineConfig(**{**config, **overrides}), loader)
    for name in ("all8", "qv4"):
        engine.add_adapter(name, tiny_adapters["llama"][name])
    return engine


def _requests(spec: list[tuple[str | None, list[int], int]]) -> list[Request]:
    return [Request(ids, adapter, SamplingParams(max_tokens=n, **GREEDY)) for adapter, ids, n in spec]


def _alone(engine: Engine, request: Request) -> list[int]:
    return engine.generate([replace(request, request_id=f"alone-{request.request_id}")])[0].token_ids


def _assert_idle(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.scheduler.running == stats.scheduler.waiting == stats.slots.active == 0
    assert stats.scheduler.kv_blocks_used == 0


def test_an_adapter_device_memory_cannot_take_fails_only_its_requests(tiny_models, tiny_adapters):
    loader = TamperingLoader(
        ModelConfig.from_dir(tiny_models["llama"]), _tampered(tiny_models, tiny_adapters)
    )
    engine = _engine(tiny_models, tiny_adapters, loader)
    requests = _requests(
        [
            (None, [5, 6, 7], 8),
            ("all8", [9, 10], 7),
            ("rank32", [11, 12, 13], 5),
            ("qv4", [14, 15, 16, 17], 6),
            ("layer-1", [18], 5),
            ("rank32", [19, 20], 5),
        ]
    )
    outputs = engine.generate(requests)
    for request, out in zip(requests, outputs, strict=True):
        if request.adapter in loader.tampered:
            assert isinstance(out.error, FailedPrecondition), out
            assert all(part in str(out.error) for part in REFUSED[request.adapter]), out.error
            assert out.finish_reason == "error" and not out.token_ids
        else:
            assert out.error is None and out.token_ids == _alone(engine, request)
    assert {s.name for s in engine.adapter_states()} <= {"all8", "qv4"}  # dropped from device and host memory
    again = engine.generate(_requests([("all8", [9, 10], 7), ("qv4", [14, 15, 16, 17], 6)]))
    assert [o.token_ids for o in again] == [outputs[1].token_ids, outputs[3].token_ids]
    _assert_idle(engine)


def test_an_adapter_larger_than_all_adapter_memory_fails_only_its_requests(tiny_models, tiny_adapters):
    """Memory for one rank-16 adapter on every module; `huge` has rank 24 on every module, as a
    store that skipped the max_lora_rank check would serve it. Draining for it could never make
    room, so its requests fail at once and every other one runs."""
    model = ModelConfig.from_dir(tiny_models["llama"])
    good = load_peft_adapter("all8", tiny_adapters["llama"]["all8"], model, 16, torch.float32)
    rank24 = {
        key: ModuleLora(torch.ones(24, m.a.shape[1]), torch.ones(24, m.b_t.shape[1]))
        for key, m in good.modules.items()
    }
    huge = replace(good, rank=24, modules=rank24)
    engine = _engine(tiny_models, tiny_adapters, TamperingLoader(model, {"huge": huge}), max_loras=1)
    requests = _requests([("all8", [9, 10], 7), ("huge", [11, 12, 13], 5), ("qv4", [14, 15, 16, 17], 6)])
    outputs = engine.generate(requests)
    assert isinstance(outputs[1].error, FailedPrecondition) and not outputs[1].token_ids
    assert "adapter 'huge' needs" in str(outputs[1].error) and "so it can never be loaded" in str(
        outputs[1].error
    )
    for i in (0, 2):
        assert outputs[i].error is None and outputs[i].token_ids == _alone(engine, requests[i])
    _assert_idle(engine)


def _overflowing_adapter(tiny_adapters, root) -> str:
    """A PEFT adapter with finite weights so large that its outputs overflow float32."""
    folder = shutil.copytree(tiny_adapters["llama"]["all8"], root / "overflow")
    path = folder / "adapter_model.safetensors"
    save_file({k: torch.full_like(t, 1e20) for k, t in load_file(path).items()}, path)
    return folder


def test_a_request_whose_logits_overflow_fails_alone_and_poisons_no_other(
    tiny_models, tiny_adapters, tmp_path
):
    engine = _engine(tiny_models, tiny_adapters)
    engine.add_adapter("overflow", _overflowing_adapter(tiny_adapters, tmp_path))
    # one-token, short and long requests first; the one-token one frees block 0, which the
    # overflowing request then takes while the short one decodes beside the long one
    brief, short, long, bad, later = _requests(
        [
            (None, [11, 12, 13], 1),
            (None, [5, 6, 7], 20),
            ("all8", [8, 9, 10], 60),
            ("overflow", [14, 15, 16, 17, 18, 19, 20, 21, 22, 23], 5),
            (None, [24, 25, 26], 12),
        ]
    )
    deltas: dict[str, list] = {r.request_id: [] for r in (short, long, brief, bad, later)}
    for r in (brief, short, long):
        engine.submit(r, deltas[r.request_id].append)
    engine.step()
    engine.submit(bad, deltas[bad.request_id].append)
    engine.step()
    assert isinstance(deltas[bad.request_id][-1].error, FailedPrecondition)
    assert "adapter 'overflow' produced NaN or Inf logits" in str(deltas[bad.request_id][-1].error)
    engine.submit(later, deltas[later.request_id].append)  # takes the failed request's blocks
    while engine.has_work:
        engine.step()
    for r in (short, long, brief, later):
        assert [t for d in deltas[r.request_id] for t in d.token_ids] == _alone(engine, r), r.adapter
        assert deltas[r.request_id][-1].error is None
    _assert_idle(engine)


def test_an_engine_failure_ends_every_request_and_refuses_new_ones(tiny_models, tiny_adapters, monkeypatch):
    engine = _engine(tiny_models, tiny_adapters, max_num_seqs=2)
    forward, calls = engine.runner.forward, []

    def failing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected: device lost")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    fatal: queue.Queue = queue.Queue()
    engine.on_fatal(fatal.put)
    ended: queue.Queue = queue.Queue()
    requests = _requests([(None, [5, 6], 50), ("all8", [7, 8], 50), ("qv4", [9, 10], 50)])  # the third waits
    for r in requests:
        engine.submit(r, lambda d: d.finish_reason and ended.put(d))
    engine.start()
    finals = [ended.get(timeout=10) for _ in requests]
    assert {d.request_id for d in finals} == {r.request_id for r in requests}
    for d in finals:
        assert d.finish_reason == "error" and isinstance(d.error, Unavailable)
        assert "RuntimeError: injected: device lost" in str(d.error)
    assert isinstance(fatal.get(timeout=1), Unavailable)
    with pytest.raises(Unavailable, match="engine failed"):
        engine.submit(_requests([(None, [5], 2)])[0], lambda d: None)
    engine.stop()


class FullDiskLoader(LocalAdapterLoader):
    """Every load fails as a fetch into a full adapter cache would."""

    def load(self, name: str, digest: str | None = None) -> ReadyAdapter:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_load_that_fails_on_the_workers_disk_is_unavailable_and_fails_only_its_requests(
    tiny_models, tiny_adapters
):
    loader = FullDiskLoader(ModelConfig.from_dir(tiny_models["llama"]), 16, torch.float32)
    engine = _engine(tiny_models, tiny_adapters, loader, max_cpu_loras=0)
    base, cold = engine.generate(_requests([(None, [5, 6, 7], 6), ("all8", [9, 10], 6)]))
    assert base.error is None and len(base.token_ids) == 6
    assert isinstance(cold.error, Unavailable) and "No space left on device" in str(cold.error)
    _assert_idle(engine)


def test_a_step_that_never_returns_ends_every_request_at_the_step_timeout(
    tiny_models, tiny_adapters, monkeypatch
):
    engine = _engine(tiny_models, tiny_adapters, step_timeout_s=0.5)
    forward, calls, released = engine.runner.forward, [], threading.Event()

    def hanging_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            released.wait()  # a hung device: the step holds the engine's lock until the test ends
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", hanging_forward)
    ended: queue.Queue = queue.Queue()
    requests = _requests([(None, [5, 6], 50), ("all8", [7, 8], 50)])
    for r in requests:
        engine.submit(r, lambda d: d.finish_reason and ended.put(d))
    engine.start()
    try:
        finals = [ended.get(timeout=10) for _ in requests]
        assert all(
            isinstance(d.error, Unavailable) and "a step ran past 0.5 s" in str(d.error) for d in finals
        )
        with pytest.raises(Unavailable):
            engine.submit(_requests([(None, [5], 2)])[0], lambda d: None)
    finally:
        released.set()
        engine.stop()


def test_an_adapter_whose_own_head_outgrows_adapter_memory_fails_naming_its_parts_sizes(tmp_path):
    """A 2,000-token vocabulary: the adapter's own lm_head is 2000 x 64 floats, 512,000 bytes, past
    the memory of one rank-16 adapter on every module; its request fails before any token, naming
    the part and its bytes, and the base model's request beside it runs."""
    from tests.conftest import build_tiny_model
    from tests.inference_service.model.test_vocab_reference import build_vocab_adapter

    model_dir = build_tiny_model(tmp_path / "model", vocab_size=2000)
    head = dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    engine = Engine(EngineConfig(model=str(model_dir), max_loras=1, kv_cache_tokens=256, block_size=4))
    engine.add_adapter("own_head", build_vocab_adapter(model_dir, tmp_path / "own_head", 1, **head))
    outputs = engine.generate(_requests([("own_head", [5, 6, 7], 4), (None, [5, 6, 7], 4)]))
    error = outputs[0].error
    assert isinstance(error, FailedPrecondition) and not outputs[0].token_ids
    assert "adapter 'own_head' needs" in str(error) and "lm_head.weight [2000, 64] 512,000 bytes" in str(
        error
    )
    assert "--adapter-memory" in str(error)
    assert outputs[1].error is None and len(outputs[1].token_ids) == 4
    _assert_idle(engine)

"""A worker serving a mixture-of-experts model (the tiny Qwen3-MoE) with adapters on attention,
router and experts fetched from a store that checked them against the same base: what the
worker reports, and that it answers as the engine does in process."""

import loramux
from bench.random_adapter import write_random_adapter
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig
from tests.adapter_store.conftest import ADMIN_TOKEN, StoreProcess, local_store_flags
from tests.e2e.conftest import WorkerProcess

PROMPTS = ([5, 6, 7, 8, 9], [11, 3, 40, 2, 17, 90, 4])


def test_an_moe_worker_serves_expert_adapters_from_the_store(tiny_moe_model, tmp_path):
    model = ModelConfig.from_dir(tiny_moe_model)
    sources = tmp_path / "sources"
    for i, name in enumerate(("experts", "attention")):
        targets = None if name == "experts" else ("q_proj", "v_proj")
        write_random_adapter(model, sources / name, rank=8, seed=i + 1, targets=targets)
    flags = local_store_flags(sources, tiny_moe_model)
    store = StoreProcess(tmp_path / "store", flags).start()
    worker = WorkerProcess(
        tiny_moe_model, store.address, tmp_path / "cache", "--kv-cache-tokens", "256"
    ).start()
    try:
        with loramux.Client(worker=worker.address, store=store.address, admin_token=ADMIN_TOKEN) as client:
            info = client.model_info()
            for name in ("experts", "attention"):
                client.register_adapter(name, f"file://{sources / name}")
            served = {
                (adapter, i): client.complete(
                    token_ids=p, adapter=adapter, max_tokens=8, temperature=0
                ).token_ids
                for adapter in ("experts", "attention", None)
                for i, p in enumerate(PROMPTS)
            }
    finally:
        worker.terminate()
        assert worker.wait() == 0
        store.stop()
    assert (info.model_type, info.num_experts, info.experts_per_token) == ("qwen3_moe", 8, 2)
    engine = Engine(EngineConfig(model=str(tiny_moe_model), kv_cache_tokens=256))
    for name in ("experts", "attention"):
        engine.add_adapter(name, sources / name)
    keys = list(served)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = engine.generate([Request(PROMPTS[i], adapter, params) for adapter, i in keys])
    assert {key: out.token_ids for key, out in zip(keys, outputs, strict=True)} == served
    assert served["experts", 0] != served[None, 0] or served["experts", 1] != served[None, 1]

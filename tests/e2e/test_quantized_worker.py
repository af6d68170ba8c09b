"""Workers serving the default model with quantized linear layers: what their weights take, by the
worker's own accounting and by the process's resident memory, and that they serve."""

from pathlib import Path

import pytest

import loramux
from tests.adapter_store.conftest import ADMIN_TOKEN, StoreProcess, local_store_flags
from tests.conftest import TINY_ADAPTERS, build_peft_adapter, build_tiny_model
from tests.e2e.conftest import WorkerProcess

# Bounds from the formats: int8 is 8 bits a weight plus a 32-bit scale per row of 576 or more
# (0.25x + under 0.2%); NF4 is 4 bits plus a 32-bit absmax per 64 (0.125x + 0.0156x).
BOUNDS = {"int8": 0.26, "nf4": 0.15}


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_dir) -> dict[str, tuple[loramux.ModelInfo, int, str]]:
    """quantization -> (model info, resident bytes, a greedy completion), one worker at a time."""
    out = {}
    for quantization in ("none", "int8", "nf4"):
        cache = tmp_path_factory.mktemp(quantization) / "cache"
        flags = ("--quantization", quantization, "--kv-cache-tokens", "512", "--max-model-len", "512")
        worker = WorkerProcess(default_model_dir, None, cache, *flags).start()
        try:
            with loramux.Client(worker=worker.address, timeout=60) as client:
                text = client.complete("The capital of France is", max_tokens=8, temperature=0).text
                out[quantization] = (client.model_info(), resident_bytes(worker.process.pid), text)
        finally:
            worker.terminate()
            worker.wait()
    return out


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_quantized_linear_weights_take_their_formats_share_of_memory(served, quantization):
    dense, dense_rss, _ = served["none"]
    info, rss, text = served[quantization]
    assert (dense.quantization, info.quantization) == ("none", quantization)
    ratio = info.linear_weight_bytes / dense.linear_weight_bytes
    assert ratio <= BOUNDS[quantization], ratio
    saved = dense.linear_weight_bytes - info.linear_weight_bytes
    # The process really holds less (the rest of its memory is the same embeddings, KV cache and
    # runtime): 94% and 83% of the accounted saving showed here for int8 and NF4, the allocator
    # keeping some of the load's temporary quantization buffers; 75% is the floor.
    assert dense_rss - rss >= 0.75 * saved, (dense_rss, rss, saved)
    assert text  # and it serves


@pytest.fixture(scope="module")
def pre_quantized(tmp_path_factory) -> dict:
    """A tiny Llama (rows of whole NF4 blocks) saved dense, as torchao saves it in int8 and as
    bitsandbytes saves it in NF4; a folder of adapters: one trained on it, one on a model whose
    MLP is wider. name -> folder."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    pytest.importorskip("bitsandbytes")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig

    root = tmp_path_factory.mktemp("pre-quantized")
    dense = build_tiny_model(root / "dense", intermediate_size=128)
    configs = {
        "int8": TorchAoConfig(Int8WeightOnlyConfig(set_inductor_config=False)),
        "nf4": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        ),
    }  # fmt: skip
    folders = {"sources": root / "sources"}
    for name, config in configs.items():
        model = AutoModelForCausalLM.from_pretrained(
            dense, quantization_config=config, dtype=torch.float32, device_map="cpu"
        )
        model.save_pretrained(root / name)
        folders[name] = root / name
    wide = build_tiny_model(root / "wide", intermediate_size=192)
    build_peft_adapter(dense, folders["sources"] / "fits", seed=1, **TINY_ADAPTERS["all8"])
    build_peft_adapter(wide, folders["sources"] / "wide", seed=1, **TINY_ADAPTERS["all8"])
    return folders


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_store_checks_adapters_against_a_pre_quantized_base_and_its_worker_serves_them(
    pre_quantized, tmp_path, quantization
):
    """The store reads the shapes from config.json, not from the packed weights; the worker on
    that folder loads the adapter and answers as the engine does in process."""
    from inference_service.engine import Engine, EngineConfig, Request
    from inference_service.sampling import SamplingParams

    base, sources = pre_quantized[quantization], pre_quantized["sources"]
    store = StoreProcess(tmp_path / "store", local_store_flags(sources, base)).start()
    worker = WorkerProcess(base, store.address, tmp_path / "cache", "--kv-cache-tokens", "256").start()
    prompt = [5, 6, 7, 8, 9]
    try:
        with loramux.Client(worker=worker.address, store=store.address, admin_token=ADMIN_TOKEN) as client:
            assert client.model_info().quantization == quantization
            client.register_adapter("fits", f"file://{sources / 'fits'}")
            wide = r"down_proj.lora_A has shape \(8, 192\), the base layer takes 128 inputs"
            with pytest.raises(loramux.InvalidArgument, match=wide):
                client.register_adapter("wide", f"file://{sources / 'wide'}")
            served = client.complete(token_ids=prompt, adapter="fits", max_tokens=8, temperature=0)
    finally:
        worker.terminate()
        worker.wait()
        store.stop()
    engine = Engine(EngineConfig(model=str(base), kv_cache_tokens=256))
    engine.add_adapter("fits", sources / "fits")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    (expected,) = engine.generate([Request(prompt, "fits", params)])
    assert served.token_ids == expected.token_ids

"""Workers serving the default model with quantized linear layers: what their weights take, by the
worker's own accounting and by the process's resident memory, and that they serve."""

from pathlib import Path

import pytest

import loramux
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

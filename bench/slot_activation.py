"""Activation of a ready adapter: copying a rank-16 all-linear adapter of the default model from
the host tier into its pages of device adapter memory (placed by AdapterMemory, copied by
ModelRunner.load_slot from the adapter's image, one copy per page of every layer), beside a
plain copy of the same tensors into preallocated buffers. The two alternate, so both see the same
machine state; p50 and p99 over many activations.

    .venv/bin/python -m bench.slot_activation [--activations 50]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.random_adapter import write_random_adapter
from inference_service.adapters.adapter_image import AdapterImage
from inference_service.engine.adapter_memory import AdapterMemory
from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from shared.peft_checkpoint import load_peft_adapter

RANK = 16


def raw_copy(image: AdapterImage):
    """A function copying every tensor of `image` into buffers allocated once."""
    sources = list(image.pages)
    targets = [torch.empty_like(t) for t in sources]

    def copy() -> None:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)

    return copy


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99)."""
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return statistics.median(samples), cuts[98]


def slot_activation(model_dir: Path, activations: int = 50) -> dict:
    config = EngineConfig(
        model=str(model_dir), max_loras=1, max_lora_rank=RANK, kv_cache_tokens=256, max_model_len=256
    )
    runner = ModelRunner(config)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_adapter(runner.model_config, Path(tmp) / "r16", RANK, seed=0)
        weights = load_peft_adapter("r16", folder, runner.model_config, RANK, runner.config.torch_dtype)
    image = AdapterImage.of(weights, runner.model_config, runner.config.torch_dtype)
    memory = AdapterMemory.for_model(runner.lora_units, runner.model_config, runner.config.torch_dtype)
    slot, _ = memory.acquire("r16", image.need)
    pages = memory.pages(slot)
    copy = raw_copy(image)
    times: dict[str, list[float]] = {"activate": [], "raw copy": []}
    for i in range(activations + 1):  # the first pair warms up and is dropped
        activate, raw = timed(lambda: runner.load_slot(slot, image, pages)), timed(copy)
        if i:
            times["activate"].append(activate)
            times["raw copy"].append(raw)
    return summary(times, image, runner.device.type)


def summary(times: dict[str, list[float]], image: AdapterImage, device: str) -> dict:
    size = sum(pages.numel() * pages.element_size() for pages in image.pages)
    activate, raw = percentiles(times["activate"]), percentiles(times["raw copy"])
    table = [
        {
            "case": f"activate host tier -> {device} adapter memory, {label}",
            "ms": round(activate[i] * 1e3, 2),
            "baseline": f"copy of the same {size / 1e6:.1f} MB, {label}",
            "baseline ms": round(raw[i] * 1e3, 2),
            "ratio": round(activate[i] / raw[i], 2),
        }
        for i, label in enumerate(("p50", "p99"))
    ]
    return {
        "setup": (
            f"a rank-{RANK} all-linear adapter of the default model ({size / 1e6:.1f} MB in the serving "
            f"dtype) copied from host memory into its pages of {device} adapter memory by "
            f"ModelRunner.load_slot (one copy per page of every layer, from the adapter's image), "
            f"alternating with a plain copy of the same tensors; {len(times['activate'])} of each"
        ),
        "table": table,
        "seconds": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--activations", type=int, default=50)
    args = parser.parse_args()
    model_dir = default_model_dir()
    result = slot_activation(model_dir, args.activations)
    print(result["setup"])
    for row in result["table"]:
        print(f"{row['case']}: {row['ms']:.2f} ms, {row['ratio']:.2f}x the plain copy")


if __name__ == "__main__":
    main()

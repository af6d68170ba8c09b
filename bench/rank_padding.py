"""What padding a rank-8 adapter up to max_lora_rank costs: decode step time on the default
model, 32 sequences over 8 distinct rank-8 all-linear adapters, with max_lora_rank 8, 16, 64,
beside the same batch without adapters. All variants are timed interleaved in one run.

    .venv/bin/python -m bench.rank_padding [--steps 20] [--repeats 5]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.random_adapter import write_random_adapter
from inference_service.engine.block_allocator import BlockAllocator
from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from inference_service.model.forward_batch import SequenceInput
from shared.peft_checkpoint import load_peft_adapter

SEQUENCES, ADAPTERS, ADAPTER_RANK, CONTEXT = 32, 8, 8, 64


def decode_seconds(runner: ModelRunner, slots: list[int], steps: int) -> float:
    """Seconds per decode step of SEQUENCES sequences after a CONTEXT-token prefill."""
    allocator = BlockAllocator(runner.num_blocks)
    tables = [allocator.allocate(-(-(CONTEXT + steps) // runner.config.block_size)) for _ in slots]
    runner.forward([SequenceInput([7] * CONTEXT, 0, t, s) for t, s in zip(tables, slots, strict=True)])
    start = time.perf_counter()
    for step in range(steps):
        runner.forward(
            [SequenceInput([11], CONTEXT + step, t, s) for t, s in zip(tables, slots, strict=True)]
        )
    return (time.perf_counter() - start) / steps


def build_runner(model_dir: Path, max_rank: int, adapter_dirs: list[Path]) -> ModelRunner:
    runner = ModelRunner(
        EngineConfig(
            model=str(model_dir), max_loras=ADAPTERS, max_lora_rank=max_rank, kv_cache_tokens=SEQUENCES * 256
        )
    )
    for slot, folder in enumerate(adapter_dirs):
        runner.load_slot(
            slot, load_peft_adapter(folder.name, folder, runner.model_config, max_rank, torch.float32)
        )
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model_dir = default_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(model_dir, 8, [])
        adapter_dirs = [
            write_random_adapter(runner.model_config, Path(tmp) / f"a{i}", ADAPTER_RANK, seed=i)
            for i in range(ADAPTERS)
        ]
        variants = {f"max_lora_rank={r}": (build_runner(model_dir, r, adapter_dirs), r) for r in (8, 16, 64)}
    mixed = sorted(i % ADAPTERS for i in range(SEQUENCES))  # grouped by slot, as the engine orders a batch
    cases = {"base (no adapters)": (variants["max_lora_rank=8"][0], [-1] * SEQUENCES)}
    cases.update({name: (runner, mixed) for name, (runner, _) in variants.items()})
    times = {name: [] for name in cases}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            for name, (runner, slots) in cases.items():
                seconds = decode_seconds(runner, slots, args.steps)
                if repeat:
                    times[name].append(seconds)
    report(times)


def report(times: dict[str, list[float]]) -> None:
    base = statistics.median(times["base (no adapters)"])
    print(
        f"decode, {SEQUENCES} sequences, {ADAPTERS} distinct rank-{ADAPTER_RANK} all-linear adapters, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'variant':<22} {'ms/step':>8} {'tok/s':>8} {'vs base':>8}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<22} {median * 1e3:8.1f} {SEQUENCES / median:8.0f} {base / median:8.3f}")


if __name__ == "__main__":
    main()

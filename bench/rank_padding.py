"""What a larger max_lora_rank costs rank-8 adapters: decode step time on the default model, 32
sequences over 8 distinct rank-8 all-linear adapters, with max_lora_rank 8, 16, 64, beside the
same batch without adapters. Each adapter takes its own pages of adapter memory (one per target
at rank 8) whatever max_lora_rank is; max_lora_rank sizes the memory and the steps' page tables
(fixed-size slots used to pad every adapter up to it). The variants are stepped in turn, one
decode step each, the order rotating: rounds of many steps drift by 10% between variants on 2
cores.

    .venv/bin/python -m bench.rank_padding [--steps 60]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.random_adapter import write_random_adapter
from inference_service.engine.adapter_memory import AdapterMemory, page_units, pages_needed
from inference_service.engine.block_allocator import BlockAllocator
from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from inference_service.model.forward_batch import SequenceInput
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter

SEQUENCES, ADAPTERS, ADAPTER_RANK, CONTEXT = 32, 8, 8, 64
MAX_RANKS = (8, 16, 64)
BASE = "base (no adapters)"
WARMUP_STEPS = 5  # per case, dropped


class DecodeCase:
    """SEQUENCES sequences on one runner, prefilled with CONTEXT tokens; step() times one decode
    step of all of them."""

    def __init__(self, runner: ModelRunner, allocator: BlockAllocator, slots: list[int], steps: int):
        self.runner, self.slots, self.position = runner, slots, CONTEXT
        blocks = -(-(CONTEXT + steps) // runner.config.block_size)
        self.tables = [allocator.allocate(blocks) for _ in slots]
        prefill = [SequenceInput([7] * CONTEXT, 0, t, s) for t, s in zip(self.tables, slots, strict=True)]
        runner.forward(prefill)

    def step(self) -> float:
        pairs = zip(self.tables, self.slots, strict=True)
        inputs = [SequenceInput([11], self.position, t, s) for t, s in pairs]
        start = time.perf_counter()
        self.runner.forward(inputs)
        self.position += 1
        return time.perf_counter() - start


def build_runner(
    model_dir: Path, max_rank: int, adapter_dirs: list[Path], steps: int
) -> tuple[ModelRunner, list[int]]:
    """A runner whose KV cache holds two cases of `steps` decode steps (base and adapters), and
    the slots of the adapters (adapter_dirs order), placed in its adapter memory as the engine
    places them."""
    runner = ModelRunner(
        EngineConfig(
            model=str(model_dir),
            max_loras=ADAPTERS,
            max_lora_rank=max_rank,
            kv_cache_tokens=2 * SEQUENCES * (CONTEXT + steps + 16),
        )
    )
    memory = AdapterMemory(runner.lora_units, page_units(runner.model_config))
    slots = []
    for folder in adapter_dirs:
        weights = load_peft_adapter(folder.name, folder, runner.model_config, max_rank, torch.float32)
        slot, _ = memory.acquire(folder.name, pages_needed(weights))
        runner.load_slot(slot, weights, memory.pages(slot))
        slots.append(slot)
    return runner, slots


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    model_dir = default_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        config = ModelConfig.from_dir(model_dir)
        adapter_dirs = [
            write_random_adapter(config, Path(tmp) / f"a{i}", ADAPTER_RANK, seed=i) for i in range(ADAPTERS)
        ]
        built = {r: build_runner(model_dir, r, adapter_dirs, args.steps) for r in MAX_RANKS}
    runners = {r: runner for r, (runner, _) in built.items()}
    # grouped by adapter, as the engine orders a batch
    mixed = {r: sorted(slots[i % ADAPTERS] for i in range(SEQUENCES)) for r, (_, slots) in built.items()}
    allocators = {r: BlockAllocator(runner.num_blocks) for r, runner in runners.items()}
    with torch.inference_mode():
        cases = {BASE: DecodeCase(runners[8], allocators[8], [-1] * SEQUENCES, args.steps)}
        for r, runner in runners.items():
            cases[f"max_lora_rank={r}"] = DecodeCase(runner, allocators[r], mixed[r], args.steps)
        times = {name: [] for name in cases}
        names = list(cases)
        for step in range(args.steps):  # one step of each case in turn, the order rotating
            for name in names[step % len(names) :] + names[: step % len(names)]:
                times[name].append(cases[name].step())
    report({name: samples[WARMUP_STEPS:] for name, samples in times.items()})


def report(times: dict[str, list[float]]) -> None:
    """Median ms per step; each variant against the base model and against max_lora_rank=8."""
    median = {name: statistics.median(samples) for name, samples in times.items()}
    print(
        f"decode, {SEQUENCES} sequences, {ADAPTERS} distinct rank-{ADAPTER_RANK} all-linear adapters, "
        f"medians of {len(times[BASE])} steps per case, cases stepped in turn; "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'variant':<22} {'ms/step':>8} {'tok/s':>8} {'vs base':>8} {'vs rank 8':>9}")
    for name, seconds in median.items():
        vs_rank8 = "" if name == BASE else f"{median['max_lora_rank=8'] / seconds:9.3f}"
        rate, vs_base = SEQUENCES / seconds, median[BASE] / seconds
        print(f"{name:<22} {seconds * 1e3:8.1f} {rate:8.0f} {vs_base:8.3f} {vs_rank8}")


if __name__ == "__main__":
    main()

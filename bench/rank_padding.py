"""What a larger max_lora_rank costs rank-8 adapters: decode step time on the default model, 32
sequences over 8 distinct rank-8 all-linear adapters, with max_lora_rank 8, 16, 64, beside the
same batch without adapters. Each adapter takes its own pages of adapter memory (one per target
at rank 8) whatever max_lora_rank is; max_lora_rank sizes the memory and the steps' page tables
(fixed-size slots used to pad every adapter up to it). The variants are stepped in turn, one
decode step each, the order rotating: rounds of many steps drift by 10% between variants on 2
cores. A round is `steps` such steps of every variant; its figure per variant is the median
step; the ratios are medians of per-round ratios.

    .venv/bin/python -m bench.rank_padding [--repeats 3] [--steps 20]
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.random_adapter import write_random_adapter
from bench.report import markdown_table
from inference_service.adapters.adapter_image import AdapterImage
from inference_service.engine.adapter_memory import AdapterMemory
from inference_service.engine.block_manager import BlockManager
from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from inference_service.model.forward_batch import SequenceInput
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter

SEQUENCES, ADAPTERS, ADAPTER_RANK, CONTEXT = 32, 8, 8, 64
MAX_RANKS = (8, 16, 64)
BASE = "base (no adapters)"
RANK8 = "max_lora_rank=8"
WARMUP_STEPS = 5  # per case, dropped
STEPS = 20  # per case and round


class DecodeCase:
    """SEQUENCES sequences on one runner, prefilled with CONTEXT tokens; step() times one decode
    step of all of them."""

    def __init__(self, runner: ModelRunner, allocator: BlockManager, slots: list[int], steps: int):
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
    model_dir: Path,
    max_rank: int,
    adapter_dirs: list[Path],
    steps: int,
    quantization: str = "none",
    dtype: str = "float32",
) -> tuple[ModelRunner, list[int]]:
    """A runner whose KV cache holds two cases of `steps` decode steps (base and adapters), and
    the slots of the adapters (adapter_dirs order), placed in its adapter memory as the engine
    places them."""
    runner = ModelRunner(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            quantization=quantization,
            max_loras=ADAPTERS,
            max_lora_rank=max_rank,
            max_model_len=CONTEXT + steps + 16,
            kv_cache_tokens=2 * SEQUENCES * (CONTEXT + steps + 16),
        )
    )
    memory = AdapterMemory.for_model(runner.lora_units, runner.model_config, runner.config.torch_dtype)
    slots = []
    for folder in adapter_dirs:
        weights = load_peft_adapter(folder.name, folder, runner.model_config, max_rank, torch.float32)
        image = AdapterImage.of(weights, runner.model_config, runner.config.torch_dtype)
        slot, _ = memory.acquire(folder.name, image.need)
        runner.load_slot(slot, image, memory.pages(slot))
        slots.append(slot)
    return runner, slots


def rank_padding(
    model_dir: Path, repeats: int = 3, progress: Callable[[str], None] = lambda line: None, steps: int = STEPS
) -> dict:
    """Every variant steps in turn; after WARMUP_STEPS dropped steps each, `repeats` rounds of
    `steps` steps each."""
    total = WARMUP_STEPS + repeats * steps
    with tempfile.TemporaryDirectory() as tmp:
        config = ModelConfig.from_dir(model_dir)
        adapter_dirs = [
            write_random_adapter(config, Path(tmp) / f"a{i}", ADAPTER_RANK, seed=i) for i in range(ADAPTERS)
        ]
        built = {r: build_runner(model_dir, r, adapter_dirs, total) for r in MAX_RANKS}
    runners = {r: runner for r, (runner, _) in built.items()}
    # grouped by adapter, as the engine orders a batch
    mixed = {r: sorted(slots[i % ADAPTERS] for i in range(SEQUENCES)) for r, (_, slots) in built.items()}
    allocators = {r: BlockManager(runner.num_blocks) for r, runner in runners.items()}
    with torch.inference_mode():
        cases = {BASE: DecodeCase(runners[8], allocators[8], [-1] * SEQUENCES, total)}
        for r, runner in runners.items():
            cases[f"max_lora_rank={r}"] = DecodeCase(runner, allocators[r], mixed[r], total)
        rounds = rotating_rounds(cases, repeats, steps, progress)
    return summary(rounds, repeats, steps)


def rotating_rounds(
    cases: dict[str, DecodeCase], repeats: int, steps: int, progress: Callable[[str], None]
) -> dict[str, list[float]]:
    """Each case's median seconds per decode step in each of `repeats` rounds of `steps` steps,
    after a round of WARMUP_STEPS dropped ones; the cases take one step each in turn, the order
    rotating, so the machine's drift favours none."""
    names = list(cases)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats + 1):
        times: dict[str, list[float]] = {name: [] for name in names}
        for step in range(WARMUP_STEPS if repeat == 0 else steps):
            for name in names[step % len(names) :] + names[: step % len(names)]:
                times[name].append(cases[name].step())
        if repeat:
            medians = {name: statistics.median(t) for name, t in times.items()}
            progress(f"round {repeat}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in medians.items()))
            for name, seconds in medians.items():
                rounds[name].append(seconds)
    return rounds


def summary(rounds: dict[str, list[float]], repeats: int, steps: int) -> dict:
    """Median ms per step of each variant; against the base model and against max_lora_rank=8 as
    medians of per-round ratios."""

    def ratios(to: str, name: str) -> list[float]:
        return [b / a for a, b in zip(rounds[name], rounds[to], strict=True)]

    table = []
    for name, seconds in rounds.items():
        step = statistics.median(seconds)
        row = {"variant": name, "ms / step": round(step * 1e3, 1), "tok/s": round(SEQUENCES / step, 1)}
        row["ratio to base"] = round(statistics.median(ratios(BASE, name)), 3)
        if name != BASE:
            to_rank8 = ratios(RANK8, name)
            row["ratio to max_lora_rank=8"] = round(statistics.median(to_rank8), 3)
            row["rounds min..max"] = f"{min(to_rank8):.3f} .. {max(to_rank8):.3f}"
        table.append(row)
    return {
        "setup": setup(repeats, steps),
        "table": table,
        "rounds": rounds,
        "ratio_to_rank8": {name: ratios(RANK8, name) for name in rounds if name != BASE},
        "torch_threads": torch.get_num_threads(),
    }


def setup(repeats: int, steps: int) -> str:
    return (
        f"Default model on the CPU, float32: one decode step of {SEQUENCES} sequences (context "
        f"{CONTEXT} tokens) over {ADAPTERS} distinct random rank-{ADAPTER_RANK} all-linear adapters, "
        f"grouped by adapter as the engine orders a batch, on a ModelRunner whose max_lora_rank is "
        f"{', '.join(map(str, MAX_RANKS))}, beside the same batch without adapters. Each adapter "
        f"takes its own pages of adapter memory whatever max_lora_rank is; max_lora_rank sizes the "
        f"memory and the steps' page tables. The variants take one step each in turn, the order "
        f"rotating, after {WARMUP_STEPS} dropped steps each; medians of {repeats} rounds of {steps} "
        f"steps per variant, ratios the medians of per-round ratios"
    )


def decode_main(doc: str, bench: Callable[..., dict], steps: int) -> None:
    """A decode benchmark run alone: --repeats rounds of --steps steps (default `steps`) on the
    default model's cache; prints its setup and table."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=steps)
    args = parser.parse_args()
    result = bench(default_model_dir(), args.repeats, print, args.steps)
    print(result["setup"] + f"; torch threads {result['torch_threads']}.")
    print(markdown_table(result["table"]))


if __name__ == "__main__":
    decode_main(__doc__, rank_padding, STEPS)

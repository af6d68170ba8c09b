"""What LoRA costs a mixture-of-experts model on the CPU: decode steps of a random-weight MoE of a
small real shape (bench/random_model.py SMALL_MOE: Granite-3.0-1B-A400M's layers, 32 experts,
top-8), 32 sequences over 8 distinct random rank-16 adapters on attention, router and every
expert, beside the same batch without adapters. Each (token, expert) pair takes its token's
adapter on its expert: an expert adapter holds 32 experts' LoRA per target. The variants step in
turn, the order rotating (as bench.rank_padding); medians of per-round ratios.

    .venv/bin/python -m bench.moe [--repeats 3] [--steps 10]
"""

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bench.random_adapter import write_random_adapter
from bench.random_model import SMALL_MOE, small_moe
from bench.rank_padding import WARMUP_STEPS, DecodeCase, build_runner, decode_main, rotating_rounds
from inference_service.engine.block_manager import BlockManager
from shared.model_config import ModelConfig

SEQUENCES, ADAPTERS, RANK = 32, 8, 16
STEPS = 10
BASE, MIXED = "base (no adapters)", "8 adapters, attention + router + experts"


def moe(
    model_dir: Path, repeats: int = 3, progress: Callable[[str], None] = lambda line: None, steps: int = STEPS
) -> dict:
    """model_dir: the default model's folder; the MoE model is written beside it once."""
    moe_dir = small_moe(model_dir.parent)
    total = WARMUP_STEPS + repeats * steps
    with tempfile.TemporaryDirectory() as tmp:
        config = ModelConfig.from_dir(moe_dir)
        adapter_dirs = [
            write_random_adapter(config, Path(tmp) / f"a{i}", RANK, seed=i) for i in range(ADAPTERS)
        ]
        runner, slots = build_runner(moe_dir, RANK, adapter_dirs, total)
    with torch.inference_mode():
        blocks = BlockManager(runner.num_blocks)
        cases = {
            BASE: DecodeCase(runner, blocks, [-1] * SEQUENCES, total),
            # grouped by adapter, as the engine orders a batch
            MIXED: DecodeCase(runner, blocks, sorted(slots[i % ADAPTERS] for i in range(SEQUENCES)), total),
        }
        rounds = rotating_rounds(cases, repeats, steps, progress)
    return summary(rounds, runner.linear_weight_bytes, repeats, steps)


def summary(rounds: dict[str, list[float]], weight_bytes: int, repeats: int, steps: int) -> dict:
    ratios = [base / mixed for base, mixed in zip(rounds[BASE], rounds[MIXED], strict=True)]
    table = [
        {
            "variant": name,
            "ms / step": round(statistics.median(seconds) * 1e3, 1),
            "tok/s": round(SEQUENCES / statistics.median(seconds), 1),
            "tok/s vs base": 1.0 if name == BASE else round(statistics.median(ratios), 3),
            "rounds min..max": "" if name == BASE else f"{min(ratios):.3f} .. {max(ratios):.3f}",
        }
        for name, seconds in rounds.items()
    ]
    return {
        "setup": setup(weight_bytes, repeats, steps),
        "table": table,
        "rounds": rounds,
        "ratios": ratios,
        "torch_threads": torch.get_num_threads(),
    }


def setup(weight_bytes: int, repeats: int, steps: int) -> str:
    shape = SMALL_MOE
    return (
        f"A random-weight Qwen3-MoE of Granite-3.0-1B-A400M's layer shape (hidden {shape['hidden_size']}, "
        f"{shape['num_experts']} experts of {shape['moe_intermediate_size']}, "
        f"top-{shape['num_experts_per_tok']}, "
        f"{shape['num_hidden_layers']} layers; {weight_bytes / 2**30:.2f} GiB of linear weights) on the CPU, "
        f"float32: one decode step of {SEQUENCES} sequences, without adapters and over {ADAPTERS} distinct "
        f"random rank-{RANK} adapters on attention, router and experts (grouped by adapter, as the engine "
        f"orders a batch). The variants take one step each in turn, the order rotating, after "
        f"{WARMUP_STEPS} dropped steps each; medians of {repeats} rounds of {steps} steps, the ratio the "
        f"median of per-round ratios"
    )


if __name__ == "__main__":
    decode_main(__doc__, moe, STEPS)

"""What quantized base weights cost or save in speed on the CPU, beside what they save in memory:
decode steps of the default model, 32 sequences over 8 distinct random rank-16 all-linear
adapters, with the linear layers dense (fp32), int8 weight-only and NF4. Quantized weights take
the compiled linear kernel (kernels/cpu_linear.cpp), int8 widened to fp32 and NF4 codes looked up
and scaled as its tiles read them, so a step reads a quarter (int8) or about a seventh (NF4) of
fp32's weight bytes. The variants step in turn, the order rotating (as bench.rank_padding);
medians of per-round ratios.

    .venv/bin/python -m bench.quantized [--repeats 3] [--steps 20]
"""

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bench.random_adapter import write_random_adapter
from bench.rank_padding import WARMUP_STEPS, DecodeCase, build_runner, decode_main, rotating_rounds
from inference_service.engine.block_manager import BlockManager
from shared.model_config import ModelConfig

SEQUENCES, ADAPTERS, RANK = 32, 8, 16
FORMATS = ("none", "int8", "nf4")
STEPS = 20


def quantized(
    model_dir: Path, repeats: int = 3, progress: Callable[[str], None] = lambda line: None, steps: int = STEPS
) -> dict:
    total = WARMUP_STEPS + repeats * steps
    with tempfile.TemporaryDirectory() as tmp:
        config = ModelConfig.from_dir(model_dir)
        adapter_dirs = [
            write_random_adapter(config, Path(tmp) / f"a{i}", RANK, seed=i) for i in range(ADAPTERS)
        ]
        built = {q: build_runner(model_dir, RANK, adapter_dirs, total, q) for q in FORMATS}
    with torch.inference_mode():
        cases = {
            q: DecodeCase(
                runner,
                BlockManager(runner.num_blocks),
                sorted(slots[i % ADAPTERS] for i in range(SEQUENCES)),
                total,
            )
            for q, (runner, slots) in built.items()
        }
        rounds = rotating_rounds(cases, repeats, steps, progress)
    weight_bytes = {q: runner.linear_weight_bytes for q, (runner, _) in built.items()}
    return summary(rounds, weight_bytes, repeats, steps)


def summary(rounds: dict[str, list[float]], weight_bytes: dict[str, int], repeats: int, steps: int) -> dict:
    def ratios(q: str) -> list[float]:
        return [dense / s for dense, s in zip(rounds["none"], rounds[q], strict=True)]

    table = []
    for q, seconds in rounds.items():
        step, per_round = statistics.median(seconds), ratios(q)
        table.append(
            {
                "linear weights": "fp32 (dense)" if q == "none" else q,
                "MB": round(weight_bytes[q] / 2**20, 1),
                "bytes vs fp32": round(weight_bytes[q] / weight_bytes["none"], 4),
                "ms / step": round(step * 1e3, 1),
                "tok/s": round(SEQUENCES / step, 1),
                "tok/s vs fp32": round(statistics.median(per_round), 3),
                "rounds min..max": f"{min(per_round):.3f} .. {max(per_round):.3f}",
            }
        )
    return {
        "setup": setup(repeats, steps),
        "table": table,
        "rounds": rounds,
        "ratios": {q: ratios(q) for q in rounds},
        "torch_threads": torch.get_num_threads(),
    }


def setup(repeats: int, steps: int) -> str:
    return (
        f"Default model on the CPU, float32 activations: one decode step of {SEQUENCES} sequences over "
        f"{ADAPTERS} distinct random rank-{RANK} all-linear adapters (grouped by adapter, as the engine "
        f"orders a batch), the linear layers' base weights dense, int8 weight-only or NF4 (quantized "
        f"as they load). The variants take one step each in turn, the order rotating, after "
        f"{WARMUP_STEPS} dropped steps each; medians of {repeats} rounds of {steps} steps per variant, "
        f"ratios the medians of per-round ratios. Quantized weights take the compiled linear kernel "
        f"(int8 widened to fp32, NF4 codes looked up and scaled, as they are read: a quarter and about "
        f"a seventh of fp32's bytes a step)"
    )


if __name__ == "__main__":
    decode_main(__doc__, quantized, STEPS)

"""What quantized base weights cost or save in speed on the CPU, beside what they save in memory:
decode steps of the default model, 32 sequences over 8 distinct random rank-16 all-linear
adapters, with the linear layers dense, int8 weight-only and NF4, under fp32 activations and,
where the CPU has AVX512-BF16, bf16 ones. Quantized weights take the compiled linear kernel
(kernels/cpu_linear.cpp), int8 widened and NF4 codes looked up and scaled as its tiles read them,
so a step reads a quarter (int8) or about a seventh (NF4) of fp32's weight bytes. The variants
step in turn, the order rotating (as bench.rank_padding); each is set against the dense layers of
its own activations, medians of per-round ratios.

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
from kernels.cpu_linear import CpuLinear
from shared.model_config import ModelConfig

SEQUENCES, ADAPTERS, RANK = 32, 8, 16
FORMATS = ("none", "int8", "nf4")
STEPS = 20


def activations() -> tuple[str, ...]:
    """fp32, and bf16 where the compiled kernel multiplies bf16 rows (AVX512-BF16)."""
    linear, _ = CpuLinear.load()
    bf16 = linear is not None and linear.runs(torch.zeros(1, 2, dtype=torch.bfloat16))
    return ("float32", "bfloat16") if bf16 else ("float32",)


def variant(dtype: str, quantization: str) -> str:
    return f"{dtype} {quantization}"


def quantized(
    model_dir: Path, repeats: int = 3, progress: Callable[[str], None] = lambda line: None, steps: int = STEPS
) -> dict:
    total = WARMUP_STEPS + repeats * steps
    with tempfile.TemporaryDirectory() as tmp:
        config = ModelConfig.from_dir(model_dir)
        adapter_dirs = [
            write_random_adapter(config, Path(tmp) / f"a{i}", RANK, seed=i) for i in range(ADAPTERS)
        ]
        built = {
            variant(d, q): build_runner(model_dir, RANK, adapter_dirs, total, q, d)
            for d in activations()
            for q in FORMATS
        }
    with torch.inference_mode():
        cases = {
            name: DecodeCase(
                runner,
                BlockManager(runner.num_blocks),
                sorted(slots[i % ADAPTERS] for i in range(SEQUENCES)),
                total,
            )
            for name, (runner, slots) in built.items()
        }
        rounds = rotating_rounds(cases, repeats, steps, progress)
    weight_bytes = {name: runner.linear_weight_bytes for name, (runner, _) in built.items()}
    return summary(rounds, weight_bytes, repeats, steps)


def summary(rounds: dict[str, list[float]], weight_bytes: dict[str, int], repeats: int, steps: int) -> dict:
    """rounds and weight_bytes by variant(): each set against the dense layers of its activations."""

    def ratios(name: str) -> list[float]:
        dense = rounds[variant(name.split()[0], "none")]
        return [d / s for d, s in zip(dense, rounds[name], strict=True)]

    fp32 = weight_bytes[variant("float32", "none")]
    table = []
    for name, seconds in rounds.items():
        dtype, q = name.split()
        step, per_round = statistics.median(seconds), ratios(name)
        table.append(
            {
                "activations": dtype,
                "linear weights": "dense" if q == "none" else q,
                "MB": round(weight_bytes[name] / 2**20, 1),
                "bytes vs fp32": round(weight_bytes[name] / fp32, 4),
                "ms / step": round(step * 1e3, 1),
                "tok/s": round(SEQUENCES / step, 1),
                "tok/s vs dense": round(statistics.median(per_round), 3),
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
        f"Default model on the CPU, fp32 activations and (where the CPU has AVX512-BF16) bf16 ones: "
        f"one decode step of {SEQUENCES} sequences over {ADAPTERS} distinct random rank-{RANK} "
        f"all-linear adapters (grouped by adapter, as the engine orders a batch), the linear layers' "
        f"base weights dense, int8 weight-only or NF4 (quantized as they load). The variants take one "
        f"step each in turn, the order rotating, after {WARMUP_STEPS} dropped steps each; medians of "
        f"{repeats} rounds of {steps} steps per variant, ratios to the dense weights under the same "
        f"activations the medians of per-round ratios. Quantized weights take the compiled linear "
        f"kernel (int8 widened, NF4 codes looked up and scaled, as they are read: a quarter and about "
        f"a seventh of fp32's bytes a step)"
    )


if __name__ == "__main__":
    decode_main(__doc__, quantized, STEPS)

"""Linear layers on the CPU side by side: two engines of the default model in one process, one with
its weights in the compiled kernel's panels (kernels/cpu_linear.py), the other in oneDNN's layout
(what a machine without a compiler runs; fp32 in blocks of 192 inputs, as the kernel sums them).
Decode step medians of the base model at several batch sizes of 32-token prompts, then the seconds
to prefill 8 prompts of 512 tokens; the engines alternate in rounds. Whether their first tokens
agree is printed (fp32: they should; bf16 may differ at a near tie).

    .venv/bin/python -m bench.cpu_linear [--dtypes float32 bfloat16] [--batches 1 8 32 128] [--rounds 4]
        [--target x86-64-v3]

--target builds the kernels for another -march, e.g. the AVX2 baseline an AVX2-only CPU's build
takes (kernels/cpu_library.py); on a CPU with AVX-512, hold torch and oneDNN to AVX2 as well
(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) to compare what such a CPU would run.
"""

import argparse
import statistics
from dataclasses import replace
from pathlib import Path
from unittest import mock

from bench.cache import default_model_dir
from bench.peers import loramux_engine
from bench.profile_decode import alternate, decode_step_seconds, timed_prefill
from inference_service.engine import Engine, model_runner
from kernels.cpu_kernels import CpuKernels
from kernels.cpu_library import NATIVE

PROMPT, LONG_PROMPT, LONG_PROMPTS, STEPS = 32, 512, 8, 8


def engines(model_dir: Path, dtype: str, batch: int, target: str) -> dict[str, Engine]:
    """Engines of up to `batch` requests, their kernels built for `target`: "kernel" with the
    compiled linear kernel, "oneDNN" as a worker whose kernel could not be built."""
    kernels, how = CpuKernels.load(target=target)
    if kernels.linear is None:
        raise SystemExit(f"no compiled linear kernel here ({how}): nothing to compare")
    built = {"kernel": kernels, "oneDNN": replace(kernels, linear=None)}
    made = {}
    for arm, arm_kernels in built.items():
        with mock.patch.object(model_runner, "_cpu_kernels", lambda k=arm_kernels: k):
            made[arm] = loramux_engine(model_dir, dtype, batch, LONG_PROMPT + 8, [])
    return made


def base_decode(batch: int):
    """The median decode step of an engine with `batch` requests on the base model."""
    return lambda engine: decode_step_seconds(engine, [None] * batch, PROMPT, STEPS)


def compare(arms: dict[str, Engine], dtype: str, batches: list[int], rounds: int) -> None:
    print(f"{dtype:9s} base decode, step ms (medians)  kernel   oneDNN  oneDNN/kernel")
    # a warm-up round each, dropped
    alternate(arms, 2, base_decode(batches[0]))
    for batch in batches:
        step = alternate(arms, rounds, base_decode(batch))
        kernel, onednn = (statistics.median(step[arm]) * 1e3 for arm in ("kernel", "oneDNN"))
        print(f"  batch {batch:3d}{'':27s}{_row(kernel, onednn)}")
    runs = alternate(arms, rounds, lambda engine: timed_prefill(engine, [None] * LONG_PROMPTS, LONG_PROMPT))
    kernel, onednn = (statistics.median(s for s, _ in runs[arm]) for arm in ("kernel", "oneDNN"))
    same = all(tokens == runs["oneDNN"][0][1] for _, tokens in runs["kernel"])
    print(f"prefill {LONG_PROMPTS} x {LONG_PROMPT} tokens, s (medians)   {_row(kernel, onednn)}")
    print(f"first tokens equal on both: {same}")


def _row(kernel: float, onednn: float) -> str:
    return f"{kernel:8.2f} {onednn:8.2f}  {onednn / kernel:13.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--target", default=NATIVE, help="the kernels' -march (default: this CPU)")
    args = parser.parse_args()
    for dtype in args.dtypes:
        arms = engines(default_model_dir(), dtype, max(args.batches), args.target)
        compare(arms, dtype, args.batches, args.rounds)


if __name__ == "__main__":
    main()

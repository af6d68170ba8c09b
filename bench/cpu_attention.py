"""CPU attention side by side in one engine: decode steps with the compiled kernel that reads the
paged cache in place (kernels/cpu_decode_attention.py) against the same steps with gathered blocks
and SDPA (the path without a compiler), the two alternating in rounds on the same requests, and the
seconds the engine takes to prefill the requests' prompts. 32 requests on the default model.

    .venv/bin/python -m bench.cpu_attention [--dtypes float32 bfloat16] [--prompts 32 512] [--rounds 6]
"""

import argparse
import statistics
from dataclasses import replace

from bench.cache import default_model_dir
from bench.engine_overhead import REQUESTS
from bench.peers import loramux_engine
from bench.profile_decode import alternate, median_step_seconds, start_decoding, timed_prefill
from inference_service.engine import Engine
from kernels.cpu_kernels import CpuKernels

STEPS = 10  # decode steps a round times, one at a time (the median is the round's)


def decode_steps(engine: Engine, prompt: int, rounds: int) -> dict[str, float]:
    """Median decode step seconds per path, over rounds that alternate which path goes first."""
    kernels = engine.runner.cpu_kernels
    paths = {"in place": kernels, "gathered": replace(kernels, decode_attention=None)}
    start_decoding(engine, [None] * REQUESTS, prompt, 2 * rounds * STEPS + 2)

    def measure(path_kernels: CpuKernels) -> float:
        engine.runner.cpu_kernels = path_kernels
        return median_step_seconds(engine, STEPS)

    steps = alternate(paths, rounds, measure)
    engine.runner.cpu_kernels = kernels
    while engine.has_work:
        engine.step()
    return {path: statistics.median(times) for path, times in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    print("dtype     prompt  prefill s  step ms in place  step ms gathered  ratio")
    for dtype in args.dtypes:
        for prompt in args.prompts:
            max_len = prompt + 2 * args.rounds * STEPS + 8
            engine = loramux_engine(default_model_dir(), dtype, REQUESTS, max_len, [])
            if engine.runner.cpu_kernels.decode_attention is None:
                raise SystemExit("no CPU decode kernel here (the worker's log says why): nothing to compare")
            prefill = statistics.median(timed_prefill(engine, [None] * REQUESTS, prompt)[0] for _ in range(3))
            step = decode_steps(engine, prompt, args.rounds)
            print(
                f"{dtype:9s} {prompt:6d}  {prefill:9.2f}  {step['in place'] * 1e3:16.2f}  "
                f"{step['gathered'] * 1e3:16.2f}  {step['in place'] / step['gathered']:.3f}"
            )


if __name__ == "__main__":
    main()

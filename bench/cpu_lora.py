"""CPU LoRA side by side in one engine: decode steps of 32 requests over 8 distinct rank-16
all-linear adapters with the compiled kernels that read adapter pages in place
(kernels/cpu_lora.py) against the same steps with pages gathered for batched matmuls (the path
without a compiler), and the base model's decode steps on the same engine: the three alternate in
rounds. The same for one request (batch 1), with adapter r16-0 and without. Then the seconds to
prefill 8 prompts of 512 tokens, one per adapter, on each LoRA path, and without adapters.
`--model larger` takes bench.random_model's larger Llama (hidden 1536 against 576), where the
same adapters are a smaller share of each layer's work. `--against REV` adds the kernels of an
earlier commit (kernels/cpu_lora.cpp and its headers at that git revision, built here) as one
more arm, so that a change to them is measured side by side in the same engine and rounds.
`--spread` measures instead the requests' adapters spread over 1, 2, 4 and 8 of the 8 (request i
takes adapter i mod n): every step multiplies the same ranks on the same targets, so the same LoRA
FLOPs, over 1 to 8 adapters' pages; `--requests` sets the batch (default 32).

    .venv/bin/python -m bench.cpu_lora [--dtypes float32 bfloat16] [--rounds 4] [--model larger]
        [--against REV | --spread [--requests N]]
"""

import argparse
import statistics
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.cache import default_model_dir
from bench.engine_overhead import REQUESTS
from bench.peers import loramux_engine
from bench.profile_decode import alternate, decode_step_seconds, timed_prefill
from bench.random_adapter import write_random_adapter
from bench.random_model import larger_llama
from inference_service.engine import Engine
from kernels.cpu_kernels import CpuKernels
from kernels.cpu_library import load_cpu_library
from kernels.cpu_lora import CpuLora
from shared.model_config import ModelConfig

ADAPTERS, RANK, PROMPT, LONG_PROMPT = 8, 16, 32, 512
SPREADS = (1, 2, 4, 8)  # distinct adapters among a step's requests (--spread)
STEPS = 8  # decode steps a round times, one at a time (the median is the round's)
REPO = Path(__file__).resolve().parents[1]


def decode_steps(engine: Engine, arms: dict[str, tuple[list[str | None], CpuKernels]], rounds: int) -> dict:
    """Median decode step seconds per arm (adapters per request, kernels), rounds alternating order."""

    def measure(arm: tuple[list[str | None], CpuKernels]) -> float:
        adapters, engine.runner.cpu_kernels = arm
        return decode_step_seconds(engine, adapters, PROMPT, STEPS)

    steps = alternate(arms, rounds, measure)
    return {arm: statistics.median(times) for arm, times in steps.items()}


def prefill_seconds(engine: Engine, names: list[str | None], kernels: CpuKernels) -> float:
    """Seconds to prefill one LONG_PROMPT-token prompt per entry of `names` (an adapter or None)
    and draw each one token."""
    engine.runner.cpu_kernels = kernels
    return timed_prefill(engine, names, LONG_PROMPT)[0]


def kernels_at(revision: str, directory: Path) -> CpuLora:
    """The CPU LoRA kernels of git `revision` (kernels/*.cpp and *.h as they were), built in
    `directory`; their entry points must take today's arguments (kernels/cpu_lora.py)."""
    git = ["git", "-C", str(REPO)]
    listed = subprocess.run(
        [*git, "ls-tree", "--name-only", revision, "kernels/"], capture_output=True, text=True
    )
    if listed.returncode != 0:
        raise SystemExit(f"--against {revision}: {listed.stderr.strip()}")
    for path in listed.stdout.split():
        if path.endswith((".cpp", ".h")):
            source = subprocess.run([*git, "show", f"{revision}:{path}"], capture_output=True, check=True)
            (directory / Path(path).name).write_bytes(source.stdout)
    library, why = load_cpu_library(directory / "cpu_lora.cpp", directory / "build")
    if library is None:
        raise SystemExit(f"--against {revision}: {why}")
    return CpuLora(library)


def paths(
    base: list[str | None], mixed: list[str | None], kernels: CpuKernels, earlier: CpuLora | None
) -> dict:
    """The arms of one comparison: the base model, the adapters on this commit's kernels, on
    gathered pages, and (--against) on an earlier commit's kernels."""
    arms = {
        "base": (base, kernels),
        "kernels": (mixed, kernels),
        "gathered": (mixed, replace(kernels, lora=None)),
    }
    if earlier is not None:
        arms["earlier"] = (mixed, replace(kernels, lora=earlier))
    return arms


def compare(
    model_dir: Path, dtype: str, folders: list[Path], rounds: int, against: tuple[str, CpuLora] | None
) -> str:
    engine = loramux_engine(model_dir, dtype, REQUESTS, LONG_PROMPT + 8, folders)
    kernels = engine.runner.cpu_kernels
    if kernels.lora is None:
        raise SystemExit("no CPU LoRA kernels here (the worker's log says why): nothing to compare")
    earlier = against[1] if against else None
    mixed = [folders[i % ADAPTERS].name for i in range(REQUESTS)]
    step = decode_steps(engine, paths([None] * REQUESTS, mixed, kernels, earlier), rounds)
    solo = decode_steps(engine, paths([None], mixed[:1], kernels, earlier), rounds)
    names = [folder.name for folder in folders]
    prefill_arms = paths([None] * ADAPTERS, names, kernels, earlier)
    prefill = {
        arm: statistics.median(times)
        for arm, times in alternate(prefill_arms, 3, lambda arm: prefill_seconds(engine, *arm)).items()
    }
    line = (
        f"{dtype:9s} {step['base'] * 1e3:7.2f}  {step['kernels'] * 1e3:10.2f}  {step['gathered'] * 1e3:11.2f}"
        f"  {step['base'] / step['kernels']:12.3f}  {step['base'] / step['gathered']:13.3f}"
        f"  {prefill['base']:16.2f}  {prefill['kernels']:9.2f}  {prefill['gathered']:10.2f}"
        f"  {prefill['base'] / prefill['kernels']:12.3f}"
        f"  {solo['base'] * 1e3:10.2f}  {solo['kernels'] * 1e3:10.2f}  {solo['base'] / solo['kernels']:12.3f}"
        f"  {solo['base'] / solo['gathered']:13.3f}"
    )
    if against is None:
        return line
    ratios = [arms["base"] / arms["earlier"] for arms in (step, solo, prefill)]
    return line + (
        f"\n{'':9s} base/kernels of {against[0]}: {ratios[0]:.3f} at {REQUESTS} requests,"
        f" {ratios[1]:.3f} at one, {ratios[2]:.3f} prefilling"
    )


def spread(model_dir: Path, dtype: str, folders: list[Path], rounds: int, requests: int) -> str:
    """Decode steps of `requests` requests without adapters and with each of SPREADS distinct
    adapters among them, alternating in rounds: base / adapters for each spread."""
    engine = loramux_engine(model_dir, dtype, requests, LONG_PROMPT + 8, folders)
    kernels = engine.runner.cpu_kernels
    arms = {"base": ([None] * requests, kernels)}
    for n in SPREADS:
        arms[n] = ([folders[i % n].name for i in range(requests)], kernels)
    step = decode_steps(engine, arms, rounds)
    ratios = "".join(f"  {step['base'] / step[n]:10.3f}" for n in SPREADS)
    return f"{dtype:9s} {requests:8d}  {step['base'] * 1e3:7.2f}{ratios}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", choices=["default", "larger"], default="default")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--against", metavar="REV", help="also the kernels of this git revision")
    choice.add_argument("--spread", action="store_true", help="the same adapters over 1 to 8 distinct ones")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="the batch of --spread")
    args = parser.parse_args()
    if args.requests != REQUESTS and not args.spread:
        parser.error("--requests sets the batch of --spread")
    model_dir = default_model_dir()
    if args.model == "larger":
        model_dir = larger_llama(model_dir.parent)
    if args.spread:
        spreads = "".join(f"{f'base/{n} adpt':>12s}" for n in SPREADS)
        print(f"dtype     requests  base ms{spreads}")
    else:
        print(
            "dtype     base ms  kernels ms  gathered ms  base/kernels  base/gathered"
            "  prefill s: base  kernels  gathered  base/kernels"
            "  batch 1: base ms  kernels ms  base/kernels  base/gathered"
        )
    with tempfile.TemporaryDirectory() as tmp:
        model = ModelConfig.from_dir(model_dir)
        folders = [
            write_random_adapter(model, Path(tmp) / f"r{RANK}-{i}", rank=RANK, seed=i + 1)
            for i in range(ADAPTERS)
        ]
        against = (args.against, kernels_at(args.against, Path(tmp))) if args.against else None
        for dtype in args.dtypes:
            if args.spread:
                print(spread(model_dir, dtype, folders, args.rounds, args.requests))
            else:
                print(compare(model_dir, dtype, folders, args.rounds, against))


if __name__ == "__main__":
    main()

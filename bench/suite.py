"""The benchmark suite behind `make bench`: runs the named benchmarks in order, printing progress,
and writes bench/results/<name>.json (figures, every round's numbers, the command, the commit,
machine and UTC time: bench/record.py), bench/results/<name>.png and bench/results/REPORT.md.

    .venv/bin/python -m bench.suite [--only NAME ...] [--repeats N] [--results bench/results]
"""

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import (
    cold_starts,
    engine_overhead,
    grpc_serving,
    hf_peft,
    http_serving,
    kv_pressure,
    many_adapters,
    moe,
    prefix_cache,
    quantized,
    rank_padding,
    scaling,
    slot_activation,
    store_register,
    structured,
    tensor_parallel,
    vocab_adapters,
)
from bench.cache import default_model_dir
from bench.record import measure, write_record
from bench.report import write_report
from shared import tcmalloc

try:
    from bench import plots
except ModuleNotFoundError as e:
    if (e.name or "").partition(".")[0] != "matplotlib":
        raise
    raise SystemExit(
        "bench.suite draws its plots with matplotlib, which is not installed: run `make bench`, or "
        "install the bench extra with .venv/bin/pip install -e '.[bench]'"
    ) from None

Progress = Callable[[str], None]
ADAPTER_COUNTS = (0, 1, 8, 32)
ACTIVATIONS = 50


def lora_overhead(model_dir: Path, repeats: int, progress: Progress) -> dict:
    return engine_overhead.lora_overhead(model_dir, ADAPTER_COUNTS, repeats, progress=progress)


def adapter_loading(model_dir: Path, repeats: int, progress: Progress) -> dict:
    registration = store_register.register_vs_read(model_dir, repeats, progress)
    progress(f"{ACTIVATIONS} slot activations")
    activation = slot_activation.slot_activation(model_dir, ACTIVATIONS)
    return {
        "setup": f"Registration: {registration['setup']}.\n\nActivation: {activation['setup']}.",
        "table": registration["table"] + activation["table"],
        "registration": registration,
        "activation": activation,
    }


def grpc_overhead(model_dir: Path, repeats: int, progress: Progress) -> dict:
    return grpc_serving.grpc_vs_in_process(model_dir, repeats, progress)


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    run: Callable[[Path, int, Progress], dict]  # (model dir, rounds, progress) -> result
    plot: Callable[[dict, Path], None]
    repeats: int  # timed rounds unless --repeats says otherwise; together about 15 min on 2 cores


BENCHMARKS = (
    Benchmark("lora_overhead", "LoRA overhead", lora_overhead, plots.lora_overhead, 3),
    Benchmark("hf_peft", "Against HF transformers + PEFT", hf_peft.hf_peft_vs_loramux, plots.hf_peft, 3),
    Benchmark("grpc_overhead", "gRPC overhead", grpc_overhead, plots.grpc_overhead, 5),
    Benchmark(
        "http_overhead", "HTTP gateway overhead", http_serving.gateway_vs_direct, plots.http_overhead, 5
    ),
    Benchmark("adapter_loading", "Adapter loading", adapter_loading, plots.adapter_loading, 5),
    Benchmark("cold_starts", "Cold starts", cold_starts.cold_starts, plots.cold_starts, 3),
    Benchmark("many_adapters", "Many adapters", many_adapters.many_adapters, plots.many_adapters, 3),
    Benchmark("rank_padding", "Rank padding", rank_padding.rank_padding, plots.rank_padding, 3),
    Benchmark("scaling", "Scaling", scaling.scaling, plots.scaling, 1),
    Benchmark("kv_pressure", "KV memory under pressure", kv_pressure.kv_pressure, plots.kv_pressure, 2),
    Benchmark("prefix_cache", "Prefix cache", prefix_cache.prefix_cache, plots.prefix_cache, 3),
    Benchmark("quantized", "Quantized base weights", quantized.quantized, plots.quantized, 3),
    Benchmark("moe", "Mixture of experts", moe.moe, plots.moe, 3),
    Benchmark(
        "tensor_parallel", "Tensor parallelism", tensor_parallel.tensor_parallel, plots.tensor_parallel, 3
    ),
    Benchmark(
        "vocab_adapters", "Vocabulary-side adapters", vocab_adapters.vocab_adapters, plots.vocab_adapters, 5
    ),
    Benchmark("structured", "Structured outputs", structured.structured, plots.structured, 5),
)


def command(args: list[str]) -> str:
    """This process's command line as one types it in the current directory (the repo root)."""
    env = [f"LORAMUX_CACHE={local(os.environ['LORAMUX_CACHE'])}"] if "LORAMUX_CACHE" in os.environ else []
    return shlex.join([*env, local(sys.executable), "-m", "bench.suite", *args])


def local(path: str) -> str:
    """`path` relative to the current directory when it lies inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def elapsed(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def progress_printer(index: int, total: int, name: str, started: float) -> Progress:
    """Prints "[2/3] name: line (1m23s)", the time counted from the suite's start."""

    def progress(line: str) -> None:
        print(f"[{index}/{total}] {name}: {line} ({elapsed(time.perf_counter() - started)})", flush=True)

    return progress


def run_one(bench: Benchmark, model_dir: Path, args, progress: Progress, argv: list[str]) -> dict:
    repeats = args.repeats or bench.repeats
    return measure(
        bench.name,
        bench.title,
        lambda: bench.run(model_dir, repeats, progress),
        command=command(argv),
        rerun=command(["--only", bench.name, "--repeats", str(repeats)]),
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    names = [b.name for b in BENCHMARKS]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=names, default=names, metavar="NAME", help=str(names))
    parser.add_argument("--repeats", type=int, help="timed rounds of every benchmark (default: its own)")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if b.name in args.only]
    args.results.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"$ {command(argv)}", flush=True)
    model_dir = default_model_dir()
    for index, bench in enumerate(chosen, 1):
        progress = progress_printer(index, len(chosen), bench.name, started)
        progress("start")
        record = run_one(bench, model_dir, args, progress, argv)
        write_record(args.results, record)
        bench.plot(record["result"], args.results / f"{bench.name}.png")
        report = write_report(args.results, names)
        progress(f"done in {record['wall_s']:.0f} s; {report}")
    print(f"all done in {elapsed(time.perf_counter() - started)}; report: {report}", flush=True)


if __name__ == "__main__":
    tcmalloc.run_again_preloaded()  # on the allocator the workers use (`make run`, the image)
    main()

"""loramux on a GPU at real model shapes, Llama-3.2-3B and Llama-3.1-8B with random weights, side
by side in one run. Per shape:
- base decode tok/s at 1, 32 and 128 concurrent requests, and the step time against the
  roofline: the bytes a decode step must read (the weights, and the adapters it uses) over the
  device's measured copy bandwidth;
- decode tok/s with 1, 8 and 32 distinct rank-16 all-linear adapters round-robin over 32 and 128
  requests, as a ratio to the base model, the two engines stepping in turn (bench.engine_overhead);
- HF transformers `generate` (base model) and HF + PEFT `generate(adapter_names=...)` (adapters) on
  the same requests and weights, decode tok/s;
- the GPU-busy fraction of a decode step (device time from torch.profiler over wall time), with
  CUDA graphs and without (`EngineConfig(cuda_graphs=False)`); issue 12's target is 80%.

Each shape's model and adapters are written at start into a temporary folder under $TMPDIR and
deleted after it (8B in bfloat16: 16 GB of weights, 5.4 GB of adapters). `--device cpu --shapes
tiny` runs every path on a tiny model, for its logic; what needs CUDA reads "n/a on cpu".

    .venv/bin/python -m bench.gpu_serving [--shapes 3b 8b] [--dtype bfloat16] [--device cuda] [--repeats 3]
"""

import argparse
import gc
import shlex
import statistics
import sys
import tempfile
import textwrap
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.cuda_timing import copy_bandwidth
from bench.engine_overhead import decode_rates, prompt_ids, timed_step
from bench.hf_peft import Job, hf_model, hf_run, peft_model
from bench.profile_decode import start_decoding
from bench.random_adapter import write_random_adapter
from bench.random_model import parameters, write_random_llama
from inference_service.engine import Engine, EngineConfig
from shared.dtypes import DTYPES
from shared.model_config import ModelConfig

LLAMA_3 = dict(
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
)
SHAPES = {
    "3b": dict(
        LLAMA_3,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        LLAMA_3,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "tiny": dict(  # for the logic, on the CPU
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
}
Case = tuple[int, int]  # (concurrent requests, distinct adapters over them; 0: the base model)
REQUESTS, ADAPTER_REQUESTS, ADAPTERS, RANK = (1, 32, 128), (32, 128), (1, 8, 32), 16
CASES: list[Case] = sorted([(r, 0) for r in REQUESTS] + [(r, n) for r in ADAPTER_REQUESTS for n in ADAPTERS])
PROFILE_STEPS = 4
MIN_TOKENS = 2 * PROFILE_STEPS + 2  # a busy-fraction run: first token, first decode, timed, profiled
NA = "n/a on cpu"
Samples = dict[Case, list[float]]
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Setup:
    """What every case of the run shares."""

    device: str
    dtype: str
    prompt: int  # tokens per request
    tokens: int  # new tokens per request
    repeats: int  # timed rounds

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class ShapeRun:
    """One shape's sizes and every round's numbers, per case."""

    shape: str
    parameters: int
    weight_bytes: int  # read by every decode step
    adapter_bytes: int  # read once per distinct adapter in a step
    ours: Samples  # decode tok/s
    ratios: Samples  # to the base engine stepping in turn with it; adapter cases only
    hf: Samples  # HF (+ PEFT) decode tok/s
    busy_graphs: dict[Case, float | None]  # device time / wall time of a decode step
    busy_eager: dict[Case, float | None]


def requests_of(case: Case) -> list[str | None]:
    """The adapter of each request: r16-0 .. r16-(n-1) round-robin, or None (the base model)."""
    requests, adapters = case
    return [f"r16-{i % adapters}" if adapters else None for i in range(requests)]


def release_memory() -> None:
    """Hand back what dropped engines and models held: they sit in reference cycles, and the CUDA
    caching allocator keeps freed blocks for the next allocation of this process."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- the model and its sizes --------------------------------------------------------------


def write_model(shape: str, folder: Path, setup: Setup) -> tuple[Path, list[Path]]:
    """The random-weight model of `shape` (seed 0, built on the device) and rank-16 all-linear
    adapters r16-0 .. r16-31 (seeds 0..31), in `folder`."""
    model_dir = write_random_llama(
        folder / "model", dtype=DTYPES[setup.dtype], device=setup.device, **SHAPES[shape]
    )
    release_memory()
    model = ModelConfig.from_dir(model_dir)
    adapters = [write_random_adapter(model, folder / f"r16-{i}", RANK, seed=i) for i in range(max(ADAPTERS))]
    return model_dir, adapters


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of weights a decode step reads: all but the embedding table, of which it reads its
    batch's rows alone (a tied table is read whole, as the LM head)."""
    model = ModelConfig.from_dir(model_dir)
    table = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    return (parameters(model_dir) - table) * DTYPES[dtype].itemsize


def adapter_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of one rank-RANK all-linear adapter's A and B in `dtype`."""
    model = ModelConfig.from_dir(model_dir)
    per_layer = sum(s.in_features + s.out_features for s in model.linear_shapes().values())
    return RANK * per_layer * model.num_layers * DTYPES[dtype].itemsize


# --- loramux ------------------------------------------------------------------------------


def loramux_engine(model_dir: Path, setup: Setup, adapters: list[Path], graphs: bool = True) -> Engine:
    """An engine sized for the largest case, with a device slot and host memory for each adapter.
    It prefills all of a case's prompts in one step, so its requests then decode in lockstep: every
    decode step measured runs the case's full batch."""
    most = max(REQUESTS)
    config = EngineConfig(
        model=str(model_dir),
        device=setup.device,
        dtype=setup.dtype,
        max_loras=len(adapters),
        max_lora_rank=RANK,
        max_cpu_loras=len(adapters),
        max_num_seqs=most,
        max_num_batched_tokens=most * setup.prompt,
        max_model_len=setup.prompt + setup.tokens + 16,  # + 16: a partly used last block
        kv_cache_tokens=most * (setup.prompt + setup.tokens + 16),
        cuda_graphs=graphs,
    )
    engine = Engine(config)
    for folder in adapters:
        engine.add_adapter(folder.name, folder)
    return engine


def ours(
    model_dir: Path, adapters: list[Path], setup: Setup, progress: Progress
) -> tuple[Samples, Samples, dict[Case, float | None]]:
    """Decode tok/s and ratios per round, and the busy fractions, on engines with CUDA graphs:
    one without adapters and one holding them all, both held at once to step in turn."""
    progress(f"loramux: engines without adapters and with {len(adapters)}")
    base, lora = loramux_engine(model_dir, setup, []), loramux_engine(model_dir, setup, adapters)
    with torch.inference_mode():
        rates, ratios = decode_rounds(base, lora, setup, progress)
        progress("loramux: GPU-busy fractions, CUDA graphs")
        # warm from the rounds: every batch size has run
        busy = busy_fractions(base, [c for c in CASES if not c[1]], setup, warm_up=False, progress=progress)
        busy |= busy_fractions(lora, [c for c in CASES if c[1]], setup, warm_up=False, progress=progress)
    base.stop()
    lora.stop()
    return rates, ratios, busy


def decode_rounds(base: Engine, lora: Engine, setup: Setup, progress: Progress) -> tuple[Samples, Samples]:
    """Per round, decode tok/s of every case and each adapter case's ratio to base. An adapter case
    steps in turn with the base engine on as many requests (whose rates count for the base case);
    a base case with no adapter case beside it steps alone."""
    rates: Samples = defaultdict(list)
    ratios: Samples = defaultdict(list)
    for r in range(setup.repeats + 1):  # round 0 warms up (compiles, fills the slots) and is dropped
        progress(f"loramux: round {r}/{setup.repeats}" if r else "loramux: warm-up round")
        for case in CASES:
            requests, adapters = case
            if not adapters and requests in ADAPTER_REQUESTS:
                continue  # measured beside each adapter case
            runs = [(base, requests_of((requests, 0))), (lora, requests_of(case))][: 2 if adapters else 1]
            flip = r % 2 == 1  # who steps first alternates
            measured = decode_rates(runs[::-1] if flip else runs, setup.prompt, setup.tokens)
            measured = measured[::-1] if flip else measured
            if r:
                rounded = ", ".join(f"{m:.1f}" for m in measured)
                progress(f"  {requests} requests, {adapters} adapters: tok/s {rounded}")
                rates[(requests, 0)].append(measured[0])
                if adapters:
                    rates[case].append(measured[1])
                    ratios[case].append(measured[1] / measured[0])
    return rates, ratios


def eager_busy(
    model_dir: Path, adapters: list[Path], setup: Setup, progress: Progress
) -> dict[Case, float | None]:
    """Busy fractions without CUDA graphs, on one engine at a time."""
    busy = {}
    for held in ([], adapters):
        progress(f"loramux: GPU-busy fractions without CUDA graphs, {len(held)} adapters")
        engine = loramux_engine(model_dir, setup, held, graphs=False)
        with torch.inference_mode():
            busy |= busy_fractions(
                engine, [c for c in CASES if bool(c[1]) == bool(held)], setup, warm_up=True, progress=progress
            )
        engine.stop()
        del engine
        release_memory()
    return busy


def busy_fractions(
    engine: Engine, cases: list[Case], setup: Setup, warm_up: bool, progress: Progress
) -> dict[Case, float | None]:
    busy = {}
    for case in cases:
        if warm_up:  # a fresh engine's first steps at a batch size compile and tune kernels
            busy_fraction(engine, requests_of(case), setup)
        busy[case] = busy_fraction(engine, requests_of(case), setup)
        progress(f"  {case[0]} requests, {case[1]} adapters: GPU busy {percent(busy[case])}%")
    return busy


def busy_fraction(engine: Engine, adapters: list[str | None], setup: Setup) -> float | None:
    """Device time over wall time of a decode step of these requests; None without CUDA. Wall
    time: PROFILE_STEPS steps without the profiler, whose per-op bookkeeping would slow down a step
    that launches its ops one by one; device time: the next PROFILE_STEPS steps in the profiler."""
    start_decoding(engine, adapters, setup.prompt, MIN_TOKENS)
    wall = sum(timed_step(engine)[0] for _ in range(PROFILE_STEPS))
    device = device_seconds(engine, PROFILE_STEPS) if setup.cuda else None
    while engine.has_work:
        engine.step()
    return None if device is None else device / wall


def device_seconds(engine: Engine, steps: int) -> float:
    """GPU time of the next `steps` steps: every activity torch.profiler records on the device
    (kernels, copies, memsets; CPU activity is recorded too: without it CUDA events have been seen
    to go missing)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.profiler.kineto_results.events()
    return sum(e.duration_ns() for e in events if e.device_type() == DeviceType.CUDA) / 1e9


# --- HF transformers + PEFT ---------------------------------------------------------------


def hf_rates(model_dir: Path, adapters: list[Path], setup: Setup, progress: Progress) -> Samples:
    """HF decode tok/s per round: the plain transformers model on the base cases, then the same
    model wrapped by PEFT with every adapter loaded on the adapter cases."""
    model = hf_model(model_dir, DTYPES[setup.dtype], setup.device)
    with torch.inference_mode():
        rates = {case: hf_decode_rates(model, case, setup, progress) for case in CASES if not case[1]}
    model = peft_model(model, adapters)
    with torch.inference_mode():
        rates |= {case: hf_decode_rates(model, case, setup, progress) for case in CASES if case[1]}
    return rates


def hf_decode_rates(model: torch.nn.Module, case: Case, setup: Setup, progress: Progress) -> list[float]:
    """Per round: requests x (tokens - 1) / (seconds of generate to `tokens` - seconds of generate
    to 1), the decode steps alone, as loramux's rate counts them (the first token comes from the
    prefill)."""
    progress(f"HF{' + PEFT' if case[1] else ''}: {case[0]} requests, {case[1]} adapters")
    jobs = [
        Job(adapter, prompt_ids(i, setup.prompt), setup.tokens) for i, adapter in enumerate(requests_of(case))
    ]
    hf_run(model, [replace(job, tokens=2) for job in jobs])  # warm-up
    rates = []
    for _ in range(setup.repeats):
        prefill = hf_run(model, [replace(job, tokens=1) for job in jobs]).seconds
        whole = hf_run(model, jobs).seconds
        rates.append(len(jobs) * (setup.tokens - 1) / (whole - prefill))
        progress(f"  tok/s {rates[-1]:.1f}")
    return rates


# --- one shape, the run, the table --------------------------------------------------------


def measure_shape(shape: str, setup: Setup, progress: Progress) -> ShapeRun:
    with tempfile.TemporaryDirectory(prefix=f"loramux-{shape}-") as tmp:
        progress(f"{shape}: random weights and {max(ADAPTERS)} adapters into {tmp}")
        model_dir, adapters = write_model(shape, Path(tmp), setup)
        rates, ratios, busy_graphs = ours(model_dir, adapters, setup, progress)
        release_memory()
        busy_eager = eager_busy(model_dir, adapters, setup, progress)
        hf = hf_rates(model_dir, adapters, setup, progress)
        release_memory()
        return ShapeRun(
            shape,
            parameters(model_dir),
            weight_bytes(model_dir, setup.dtype),
            adapter_bytes(model_dir, setup.dtype),
            rates,
            ratios,
            hf,
            busy_graphs,
            busy_eager,
        )


def gpu_serving(shapes: list[str], setup: Setup, progress: Progress = lambda line: None) -> dict:
    bandwidth = copy_bandwidth() if setup.cuda else None
    runs = [measure_shape(shape, setup, progress) for shape in shapes]
    return summary(runs, bandwidth, setup)


def summary(runs: list[ShapeRun], bandwidth: float | None, setup: Setup) -> dict:
    return {
        "setup": setup_text(setup),
        "device": device_name(setup),
        "dtype": setup.dtype,
        "copy_bandwidth": f"{bandwidth / 1e9:.0f} GB/s" if bandwidth else NA,
        "shapes": [shape_line(run) for run in runs],
        "table": [row(run, case, bandwidth) for run in runs for case in CASES],
        "values": {
            run.shape: {
                name: {f"{c} requests, {n} adapters": v for (c, n), v in getattr(run, name).items()}
                for name in ("ours", "ratios", "hf", "busy_graphs", "busy_eager")
            }
            for run in runs
        },
    }


def device_name(setup: Setup) -> str:
    return (
        torch.cuda.get_device_name(setup.device) if setup.cuda else f"cpu, {torch.get_num_threads()} threads"
    )


def row(run: ShapeRun, case: Case, bandwidth: float | None) -> dict:
    requests, adapters = case
    rate, hf = statistics.median(run.ours[case]), statistics.median(run.hf[case])
    step = requests / rate
    roofline = (run.weight_bytes + adapters * run.adapter_bytes) / bandwidth if bandwidth else None
    return {
        "shape": run.shape,
        "requests": requests,
        "adapters": adapters,
        "decode tok/s": round(rate, 1),
        "ratio to base": round(statistics.median(run.ratios[case]), 3) if adapters else "-",
        "step ms": round(step * 1e3, 2),
        "roofline ms": round(roofline * 1e3, 2) if roofline else NA,
        "x roofline": round(step / roofline, 2) if roofline else NA,
        "HF(+PEFT) tok/s": round(hf, 1),
        "ours / HF": round(rate / hf, 2),
        "GPU busy % graphs": percent(run.busy_graphs[case]),
        "GPU busy % eager": percent(run.busy_eager[case]),
    }


def percent(fraction: float | None) -> str:
    return NA if fraction is None else f"{100 * fraction:.0f}"


def shape_line(run: ShapeRun) -> str:
    model = {"3b": "Llama-3.2-3B", "8b": "Llama-3.1-8B"}.get(run.shape, "tiny Llama")
    return (
        f"{run.shape}: {model} shape, {run.parameters / 1e6:.1f} M parameters (random); a decode step "
        f"reads {run.weight_bytes / 1e6:.1f} MB of weights, plus {run.adapter_bytes / 1e6:.1f} MB per "
        f"distinct rank-{RANK} adapter"
    )


def setup_text(setup: Setup) -> str:
    return (
        f"Every request: {setup.prompt} prompt tokens (one id repeated), {setup.tokens} "
        f"new tokens, greedy, EOS ignored; adapters: distinct random rank-{RANK} all-linear adapters "
        f"round-robin over the requests. Decode tok/s counts decode steps only (the first token comes "
        f"from the prefill). loramux prefills a case's prompts in one step, so every decode step runs "
        f"the case's full batch; medians of {setup.repeats} rounds after a dropped warm-up "
        f"round; an adapter case's engine (max_loras {max(ADAPTERS)}, CUDA graphs) steps in turn with "
        f"the base engine on as many requests, and its ratio is the median of per-round ratios. "
        f"Roofline: the bytes a step reads (weights, and each distinct adapter) / copy bandwidth; "
        f"step ms = requests / tok/s. HF: transformers generate on the same model folder and "
        f"requests (batch = the requests, same max_new_tokens), PEFT generate(adapter_names=...) with "
        f"adapters in {setup.dtype}; tok/s = requests x (tokens - 1) / (generate(tokens) - "
        f"generate(1)) seconds, median of {setup.repeats}. GPU busy: device time (kernels, copies) "
        f"of {PROFILE_STEPS} decode steps in torch.profiler / wall time of {PROFILE_STEPS} unprofiled "
        f"steps before them, with CUDA graphs and with cuda_graphs=False (target: 80%)"
    )


def text_table(rows: list[dict]) -> list[str]:
    """Right-aligned columns under their names."""
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.rjust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c]).rjust(widths[c]) for c in columns) for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["3b", "8b"])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    if args.tokens < MIN_TOKENS:
        parser.error(f"--tokens must be at least {MIN_TOKENS}")
    setup = Setup(args.device, args.dtype, args.prompt, args.tokens, args.repeats)
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {line}", flush=True)

    result = gpu_serving(args.shapes, setup, progress)
    print(f"\n$ {shlex.join([sys.executable, '-m', 'bench.gpu_serving', *sys.argv[1:]])}")
    took = time.perf_counter() - started
    print(
        f"{result['device']}; {result['dtype']}; copy bandwidth {result['copy_bandwidth']}; took {took:.0f} s"
    )
    print(textwrap.fill(result["setup"], 110, break_on_hyphens=False))
    print("\n".join(result["shapes"]))
    print("\n".join(text_table(result["table"])))


if __name__ == "__main__":
    main()

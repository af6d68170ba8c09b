"""The prefix cache, on the default model with random rank-16 adapters: the same requests with
caching on and off, side by side.

Shared system prompts. Each adapter has a system prompt of its own of SYSTEM tokens; 8 requests
per adapter each ask a distinct question of QUESTION tokens after it, CLIENTS at a time (a new
one as each ends, the adapters taking turns). Figures: prompt tokens computed (a prompt's tokens
less those its request found cached) and time to first token, p50. With 8 requests per adapter
the computed share is (SYSTEM + 8 QUESTION) / (8 (SYSTEM + QUESTION)) whatever the number of
adapters, so 2 adapters by default keep the caching-off side within minutes on a CPU; --adapters
8 runs the full shape.

No shared prefix. Distinct prompts: caching on can only cost (hashing every full block, keeping
freed ones). Both sides run the same requests in lock step, one engine step each in turn, so
the machine's drift reaches both alike; generated tokens/s over each side's own step time.

    LORAMUX_CACHE=.cache .venv/bin/python -m bench.prefix_cache [--adapters 2] [--repeats 3]
"""

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.random_adapter import write_random_adapter
from bench.report import markdown_table
from inference_service.engine import Delta, Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig

SYSTEM, QUESTION, PER_ADAPTER, NEW_TOKENS, CLIENTS, RANK = 2048, 32, 8, 8, 4, 16
DISTINCT, DISTINCT_PROMPT, DISTINCT_TOKENS = 16, 256, 32
ON, OFF = "caching on", "caching off"


def engines(model_dir: Path, folders: list[Path]) -> dict[str, Engine]:
    built = {}
    for side, caching in ((ON, True), (OFF, False)):
        config = EngineConfig(
            model=str(model_dir), max_loras=len(folders), max_lora_rank=RANK, prefix_caching=caching
        )
        built[side] = Engine(config)
        for folder in folders:
            built[side].add_adapter(folder.name, folder)
    return built


def closed_loop(
    engine: Engine, requests: list[Request], clients: int
) -> tuple[list[Delta], list[float], float]:
    """Every request, at most `clients` in flight, the next submitted as one ends. Returns each
    request's last delta and time to first token, and the seconds for all."""
    pending, in_flight = list(requests), {}
    finals: dict[str, Delta] = {}
    first_token: dict[str, float] = {}
    submitted: dict[str, float] = {}

    def submit(request: Request) -> None:
        def sink(delta: Delta, rid=request.request_id) -> None:
            if delta.token_ids and rid not in first_token:
                first_token[rid] = time.perf_counter() - submitted[rid]
            if delta.finish_reason is not None:
                finals[rid] = delta
                del in_flight[rid]

        submitted[request.request_id] = time.perf_counter()
        in_flight[request.request_id] = request
        engine.submit(request, sink)

    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < clients:
            submit(pending.pop(0))
        engine.step()
    seconds = time.perf_counter() - start
    return [finals[r.request_id] for r in requests], [first_token[r.request_id] for r in requests], seconds


def lockstep(engines: dict[str, Engine], requests: list[Request]) -> dict[str, float]:
    """Every request on every engine, all in flight, the engines taking one step each in turn;
    generated tokens over each engine's own time in its steps."""
    finals: dict[str, list[Delta]] = {side: [] for side in engines}
    seconds = dict.fromkeys(engines, 0.0)
    for side, engine in engines.items():
        for request in requests:
            engine.submit(request, lambda d, out=finals[side]: d.finish_reason and out.append(d))
    while any(len(done) < len(requests) for done in finals.values()):
        for side, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            seconds[side] += time.perf_counter() - start
    return {side: sum(d.completion_tokens for d in finals[side]) / seconds[side] for side in engines}


def shared_requests(adapters: list[str], vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    systems = {a: [rng.randrange(17, vocab) for _ in range(SYSTEM)] for a in adapters}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [
        Request(
            systems[a] + [rng.randrange(17, vocab) for _ in range(QUESTION)], a, params, f"s{seed}-{i}-{a}"
        )
        for i in range(PER_ADAPTER)
        for a in adapters  # the adapters take turns
    ]


def distinct_requests(adapters: list[str], vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=DISTINCT_TOKENS, temperature=0, ignore_eos=True)
    return [
        Request(
            [rng.randrange(17, vocab) for _ in range(DISTINCT_PROMPT)],
            adapters[i % len(adapters)],
            params,
            f"d{seed}-{i}",
        )
        for i in range(DISTINCT)
    ]


def prefix_cache(
    model_dir: Path, repeats: int = 3, progress: Callable[[str], None] = lambda line: None, adapters: int = 2
) -> dict:
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model = ModelConfig.from_dir(model_dir)
        folders = [
            write_random_adapter(model, Path(tmp) / f"r{RANK}-{i}", RANK, seed=i) for i in range(adapters)
        ]
        built = engines(model_dir, folders)
        names = [f.name for f in folders]
        vocab = built[ON].model_config.vocab_size
        shared = {}
        for side in (ON, OFF):
            finals, ttft, seconds = closed_loop(built[side], shared_requests(names, vocab, 0), CLIENTS)
            computed = sum(f.prompt_tokens - f.cached_tokens for f in finals)
            shared[side] = {"computed": computed, "ttft": ttft, "seconds": seconds}
            progress(
                f"shared system prompts, {side}: {computed} prompt tokens computed, TTFT p50 "
                f"{statistics.median(ttft):.2f} s, {seconds:.1f} s in all"
            )
        distinct: dict[str, list[float]] = {ON: [], OFF: []}
        for repeat in range(repeats):
            rates = lockstep(built, distinct_requests(names, vocab, 100 + repeat))
            for side, rate in rates.items():
                distinct[side].append(rate)
            rates = ", ".join(f"{side} {distinct[side][-1]:.1f}" for side in (ON, OFF))
            progress(f"no shared prefix, round {repeat + 1}: {rates} tok/s")
    return summary(shared, distinct, adapters, repeats)


def summary(shared: dict, distinct: dict[str, list[float]], adapters: int, repeats: int) -> dict:
    ttft = {side: statistics.median(values["ttft"]) for side, values in shared.items()}
    ratios = [on / off for on, off in zip(distinct[ON], distinct[OFF], strict=True)]
    table = [
        {
            "case": f"shared system prompts, {side}",
            "prompt tokens computed": values["computed"],
            "TTFT p50 s": round(ttft[side], 2),
            "tok/s": "",
        }
        for side, values in shared.items()
    ]
    table.append(
        {
            "case": "shared system prompts, on / off",
            "prompt tokens computed": round(shared[ON]["computed"] / shared[OFF]["computed"], 3),
            "TTFT p50 s": round(ttft[ON] / ttft[OFF], 3),
            "tok/s": "",
        }
    )
    for side in (ON, OFF):
        table.append(
            {
                "case": f"no shared prefix, {side}",
                "prompt tokens computed": "",
                "TTFT p50 s": "",
                "tok/s": round(statistics.median(distinct[side]), 1),
            }
        )
    table.append(
        {
            "case": "no shared prefix, on / off",
            "prompt tokens computed": "",
            "TTFT p50 s": "",
            "tok/s": round(statistics.median(ratios), 3),
        }
    )
    return {
        "setup": setup(adapters, repeats),
        "table": table,
        "ttft": {side: values["ttft"] for side, values in shared.items()},
        "distinct_ratios": ratios,
        "torch_threads": torch.get_num_threads(),
    }


def setup(adapters: int, repeats: int) -> str:
    return (
        f"Default model on the CPU, float32, {adapters} random rank-{RANK} all-linear adapters. Shared "
        f"system prompts: each adapter's own {SYSTEM}-token system prompt, then {PER_ADAPTER} distinct "
        f"{QUESTION}-token questions per adapter, {NEW_TOKENS} new tokens each, {CLIENTS} requests in "
        f"flight (a new one as each ends, the adapters taking turns); prompt tokens computed are "
        f"prompt tokens less cached ones. No shared prefix: {DISTINCT} distinct {DISTINCT_PROMPT}-token "
        f"prompts, {DISTINCT_TOKENS} new tokens each, all in flight, the two engines stepping in turn; "
        f"medians of {repeats} rounds, the ratio the median of per-round ratios"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = prefix_cache(default_model_dir(), args.repeats, print, args.adapters)
    print(result["setup"] + f"; torch threads {result['torch_threads']}.")
    print(markdown_table(result["table"]))


if __name__ == "__main__":
    main()

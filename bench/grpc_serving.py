"""Serving over gRPC against the in-process engine, on the default model: tokens/s of 32
concurrent greedy streams (8 distinct rank-16 adapters) through the SDK (`loramux.Client`) to a
real store and worker process, against Engine.generate on the same requests in this process.
Rounds time both sides back to back, the first side alternating; medians are printed.

    .venv/bin/python -m bench.grpc_serving [--repeats 5]
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import loramux
from bench.cache import default_model_dir
from bench.local_stack import local_stack
from bench.random_adapter import write_random_adapter
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig

STREAMS, ADAPTERS, RANK, PROMPT, TOKENS = 32, 8, 16, 32, 32
ENGINE = {
    "max_loras": ADAPTERS,
    "max_lora_rank": RANK,
    "max_cpu_loras": 2 * ADAPTERS,
    "max_num_seqs": STREAMS,
}


def requests() -> list[tuple[str, list[int]]]:
    return [(f"r16-{i % ADAPTERS}", [100 + i] * PROMPT) for i in range(STREAMS)]


def in_process_rate(engine: Engine) -> float:
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    batch = [Request(ids, adapter, params) for adapter, ids in requests()]
    start_t = time.perf_counter()
    outputs = engine.generate(batch)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start_t)


def stream(client: loramux.Client, adapter: str, ids: list[int]) -> int:
    """Tokens received."""
    deltas = client.generate(
        token_ids=ids, adapter=adapter, max_tokens=TOKENS, temperature=0, ignore_eos=True, timeout=600
    )
    return sum(len(delta.token_ids) for delta in deltas)


def grpc_rate(client: loramux.Client) -> float:
    start_t = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        counts = list(pool.map(lambda r: stream(client, *r), requests()))
    return sum(counts) / (time.perf_counter() - start_t)


def grpc_vs_in_process(
    model_dir: Path, repeats: int = 5, progress: Callable[[str], None] = lambda line: None
) -> dict:
    """Tokens/s over gRPC and in process: per round, medians, ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "adapters"
        model = ModelConfig.from_dir(model_dir)
        folders = [write_random_adapter(model, root / f"r16-{i}", RANK, seed=i) for i in range(ADAPTERS)]
        engine = Engine(
            EngineConfig(model=str(model_dir), kv_cache_tokens=STREAMS * 96, max_model_len=96, **ENGINE)
        )
        for folder in folders:
            engine.add_adapter(folder.name, folder)
        progress("starting a store and a worker")
        flags = ["--max-loras", str(ADAPTERS), "--max-cpu-loras", str(2 * ADAPTERS)]
        flags += ["--kv-cache-tokens", str(STREAMS * 96 + 512), "--max-model-len", "96"]
        with local_stack(model_dir, root, Path(tmp), *flags) as client:
            return summary(measure(engine, client, folders, repeats, progress), repeats)


def measure(
    engine: Engine, client: loramux.Client, folders: list[Path], repeats: int, progress: Callable[[str], None]
) -> dict[str, list[float]]:
    for folder in folders:
        client.register_adapter(folder.name, f"file://{folder}")
    results: dict[str, list[float]] = {"in-process": [], "grpc": []}
    progress("warm-up round")
    grpc_rate(client)  # adapters fetched and resident
    in_process_rate(engine)
    sides = {"in-process": lambda: in_process_rate(engine), "grpc": lambda: grpc_rate(client)}
    for i in range(repeats):
        progress(f"round {i + 1}/{repeats}")
        for side in sorted(sides, reverse=i % 2 == 1):  # the first side alternates: drift favours neither
            results[side].append(sides[side]())
    return results


def summary(results: dict[str, list[float]], repeats: int) -> dict:
    """Medians, and the medians of per-round ratios (each round times both sides back to back)."""
    ratios = {"grpc": [g / p for g, p in zip(results["grpc"], results["in-process"], strict=True)]}
    median = {name: statistics.median(values) for name, values in results.items()}
    table = [
        {
            "case": f"{STREAMS} concurrent SDK streams over gRPC, tok/s",
            "value": round(median["grpc"], 1),
            "baseline": "Engine.generate in process, tok/s",
            "baseline value": round(median["in-process"], 1),
            "ratio": round(statistics.median(ratios["grpc"]), 3),
        },
    ]
    return {
        "setup": (
            f"default model, {STREAMS} streams x ({PROMPT} prompt + {TOKENS} new tokens), greedy, "
            f"{ADAPTERS} distinct rank-{RANK} adapters, through a store and a worker process on the same "
            f"machine; medians of {repeats} rounds, each timing both sides back to back (the first "
            "side alternating between rounds, so the machine's drift favours neither), after a warm-up round"
        ),
        "table": table,
        "values": results,
        "ratios": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model_dir = default_model_dir()
    result = grpc_vs_in_process(model_dir, args.repeats)
    print(result["setup"])
    for row in result["table"]:
        print(f"{row['case']}: {row['value']} against {row['baseline']} {row['baseline value']}")
        print(f"    ratio {row['ratio']}")


if __name__ == "__main__":
    main()

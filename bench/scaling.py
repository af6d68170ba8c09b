"""Scaling curves, on the default model and on a random-weight Llama twice its size:
- decode tokens/s against concurrency (1..64 requests), base model and 8 distinct rank-16
  all-linear adapters;
- decode tokens/s against adapter rank (8..64), 32 requests over 8 distinct adapters, each rank
  on its own engine (max_lora_rank = rank), against the base model.
Every engine of a model takes its steps in turn with the others (bench.engine_overhead), so the
ratios compare the same moments of the machine.

    .venv/bin/python -m bench.scaling [--repeats 2]
"""

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.engine_overhead import decode_rates
from bench.random_adapter import write_random_adapter
from bench.random_model import larger_llama, parameters
from inference_service.engine import Engine, EngineConfig

Progress = Callable[[str], None]
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
RANKS = (8, 16, 32, 64)
ADAPTERS, RANK_REQUESTS, CURVE_RANK = 8, 32, 16
PROMPT, TOKENS = 16, 12


def engine(model_dir: Path, rank: int) -> Engine:
    config = EngineConfig(
        model=str(model_dir),
        max_loras=ADAPTERS,
        max_lora_rank=rank,
        max_cpu_loras=ADAPTERS,
        max_num_seqs=max(CONCURRENCY),
        max_model_len=PROMPT + TOKENS + 16,
        kv_cache_tokens=max(CONCURRENCY) * (PROMPT + TOKENS + 16),
    )
    return Engine(config)


def engines(model_dir: Path, adapters_dir: Path, progress: Progress) -> dict[int, Engine]:
    """Rank -> an engine holding 8 random adapters of that rank (r{rank}-0..7); 0 -> no adapters."""
    built = {0: engine(model_dir, min(RANKS))}
    model = built[0].model_config
    for rank in RANKS:
        progress(f"{model_dir.name}: engine with {ADAPTERS} rank-{rank} adapters")
        built[rank] = engine(model_dir, rank)
        for i in range(ADAPTERS):
            folder = write_random_adapter(model, adapters_dir / f"r{rank}-{i}", rank, seed=rank * 100 + i)
            built[rank].add_adapter(folder.name, folder)
    return built


def names(rank: int, requests: int) -> list[str | None]:
    return [f"r{rank}-{i % ADAPTERS}" if rank else None for i in range(requests)]


def curves(model_dir: Path, repeats: int, progress: Progress) -> dict:
    """Per round: tok/s of base and LoRA at each concurrency, and of each rank at 32 requests."""
    with tempfile.TemporaryDirectory() as tmp:
        built = engines(model_dir, Path(tmp), progress)
    concurrency: dict[str, dict[int, list[float]]] = {"base": {}, "lora": {}}
    ranks: dict[int, list[float]] = {}
    with torch.inference_mode():
        for r in range(repeats + 1):  # round 0 warms every engine up and is dropped
            progress(f"{model_dir.name}: " + (f"round {r}/{repeats}" if r else "warm-up round"))
            for c in CONCURRENCY if r else (ADAPTERS,):
                pair = [(built[0], names(0, c)), (built[CURVE_RANK], names(CURVE_RANK, c))]
                rates = decode_rates(pair, PROMPT, TOKENS)
                if r:
                    concurrency["base"].setdefault(c, []).append(rates[0])
                    concurrency["lora"].setdefault(c, []).append(rates[1])
            runs = [(built[rank], names(rank, RANK_REQUESTS)) for rank in (0, *RANKS)]
            for rank, rate in zip((0, *RANKS), decode_rates(runs, PROMPT, TOKENS), strict=True):
                if r:
                    ranks.setdefault(rank, []).append(rate)
    return {"concurrency": concurrency, "rank": ranks}


def scaling(model_dir: Path, repeats: int = 2, progress: Progress = lambda line: None) -> dict:
    models = {"default": model_dir}
    progress("the larger random Llama (written once, beside the default model)")
    models["larger"] = larger_llama(model_dir.parent)
    measured = {name: curves(path, repeats, progress) for name, path in models.items()}
    return summary(models, measured, repeats)


def label(model_dir: Path) -> str:
    return f"{model_dir.name} ({parameters(model_dir) / 1e6:.0f}M)"


def summary(models: dict[str, Path], measured: dict[str, dict], repeats: int) -> dict:
    table = []
    for name, m in measured.items():
        base, lora = m["concurrency"]["base"], m["concurrency"]["lora"]
        for c in CONCURRENCY:
            table.append(row(models[name], "concurrency", c, base[c], lora[c]))
        for rank in RANKS:
            table.append(row(models[name], "rank", rank, m["rank"][0], m["rank"][rank]))
    return {
        "setup": (
            f"decode tok/s ({PROMPT} prompt + {TOKENS} new tokens per request, greedy, decode steps "
            f"only). Concurrency: N requests on the base model against N requests over "
            f"{ADAPTERS} distinct rank-{CURVE_RANK} all-linear adapters. Rank: {RANK_REQUESTS} "
            f"requests over {ADAPTERS} distinct all-linear adapters of that rank, each rank on its own "
            f"engine with max_lora_rank = rank, against the base model. Models: "
            + "; ".join(label(path) for path in models.values())
            + f" (random weights, hidden 1536, 8 layers). Medians of {repeats} timed round(s) after a "
            f"warm-up round; the engines of a model step in turn"
        ),
        "table": table,
        "models": {name: label(path) for name, path in models.items()},
        "values": {
            name: {
                "concurrency": {k: {str(c): v for c, v in d.items()} for k, d in m["concurrency"].items()},
                "rank": {str(rank): v for rank, v in m["rank"].items()},
            }
            for name, m in measured.items()
        },
    }


def row(model_dir: Path, curve: str, x: int, base: list[float], lora: list[float]) -> dict:
    ratios = [a / b for a, b in zip(lora, base, strict=True)]
    return {
        "model": model_dir.name,
        "curve": curve,
        "at": f"{x} requests" if curve == "concurrency" else f"rank {x}",
        "base tok/s": round(statistics.median(base), 1),
        "LoRA tok/s": round(statistics.median(lora), 1),
        "ratio": round(statistics.median(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model_dir = default_model_dir()
    result = scaling(model_dir, args.repeats, print)
    print(result["setup"])
    for r in result["table"]:
        print("  ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()

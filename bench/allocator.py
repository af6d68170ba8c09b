"""tcmalloc against glibc's malloc under CPU decode: the default model's base decode tok/s at
batches 1, 8 and 32, fp32 and bf16. The allocator is chosen when a process starts (LD_PRELOAD:
shared/tcmalloc.py), so each arm runs in a process of its own: pair by pair, one process on each,
the arm that goes first alternating, and each process says which allocator it ran on. Reports
tcmalloc / glibc: the median of the pairs' ratios, and their range.

    .venv/bin/python -m bench.allocator [--pairs 6] [--dtypes float32 bfloat16]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.engine_overhead import decode_rate
from inference_service.engine import Engine, EngineConfig
from shared import tcmalloc

BATCHES = (1, 8, 32)
PROMPT, TOKENS = 32, 64
ARMS = ("glibc", "tcmalloc")


def arm_env(arm: str) -> dict[str, str]:
    """This process's environment with tcmalloc preloaded (where installed) or kept out."""
    if arm == "tcmalloc":
        return tcmalloc.preloading(os.environ)
    preloaded = os.environ.get("LD_PRELOAD", "").split(":")
    kept = ":".join(lib for lib in preloaded if lib and "tcmalloc" not in lib)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return env | ({"LD_PRELOAD": kept} if kept else {})


def rates(model_dir: Path, dtype: str, batches: tuple[int, ...], tokens: int) -> dict[int, float]:
    """Base decode tok/s at each batch on one engine: the median of 3 runs after a warm-up."""
    longest = PROMPT + tokens + 16
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            max_loras=0,
            max_num_seqs=max(batches),
            kv_cache_tokens=max(batches) * longest,
            max_model_len=longest,
        )
    )
    with torch.inference_mode():
        decode_rate(engine, [None] * max(batches), PROMPT, 8)
        return {
            b: statistics.median(decode_rate(engine, [None] * b, PROMPT, tokens) for _ in range(3))
            for b in batches
        }


def run_arm(arm: str, model_dir: Path, dtype: str, batches: tuple[int, ...], tokens: int) -> dict[int, float]:
    """One process on `arm`'s allocator; refused if it ran on the other one."""
    command = [sys.executable, "-m", "bench.allocator", "--child", arm, "--model", str(model_dir)]
    command += ["--dtypes", dtype, "--batches", *map(str, batches), "--tokens", str(tokens)]
    done = subprocess.run(command, env=arm_env(arm), capture_output=True, text=True, check=True)
    reply = json.loads(done.stdout.splitlines()[-1])
    if reply["malloc"] != arm:
        raise RuntimeError(f"the {arm} arm's process ran on {reply['malloc']}")
    return {int(b): rate for b, rate in reply["rates"].items()}


def compare(
    model_dir: Path, dtypes: list[str], pairs: int, batches: tuple[int, ...] = BATCHES, tokens: int = TOKENS
) -> dict:
    """Per dtype and batch: each arm's tok/s per pair, and tcmalloc / glibc per pair."""
    result = {}
    for dtype in dtypes:
        runs: dict[str, list[dict[int, float]]] = {arm: [] for arm in ARMS}
        for pair in range(pairs):
            for arm in ARMS[:: 1 if pair % 2 == 0 else -1]:
                runs[arm].append(run_arm(arm, model_dir, dtype, batches, tokens))
        result[dtype] = {
            batch: {
                "glibc": [r[batch] for r in runs["glibc"]],
                "tcmalloc": [r[batch] for r in runs["tcmalloc"]],
                "ratio": [t[batch] / g[batch] for t, g in zip(runs["tcmalloc"], runs["glibc"], strict=True)],
            }
            for batch in batches
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--model", type=Path, help="default: the default model")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)  # one arm's process
    args = parser.parse_args()
    model_dir = args.model or default_model_dir()
    batches = tuple(args.batches)
    if args.child:
        measured = rates(model_dir, args.dtypes[0], batches, args.tokens)
        print(json.dumps({"malloc": "tcmalloc" if tcmalloc.loaded() else "glibc", "rates": measured}))
        return
    if tcmalloc.library() is None:
        raise SystemExit("tcmalloc is not installed here (Debian's libtcmalloc-minimal4): nothing to compare")
    for dtype, by_batch in compare(model_dir, args.dtypes, args.pairs, batches, args.tokens).items():
        for batch, arms in by_batch.items():
            ratio = arms["ratio"]
            print(
                f"{dtype} batch {batch}: glibc {statistics.median(arms['glibc']):.1f} tok/s, tcmalloc "
                f"{statistics.median(arms['tcmalloc']):.1f}; tcmalloc / glibc {statistics.median(ratio):.3f} "
                f"({min(ratio):.3f} to {max(ratio):.3f} over {len(ratio)} pairs)"
            )


if __name__ == "__main__":
    main()

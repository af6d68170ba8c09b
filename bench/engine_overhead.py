"""LoRA overhead of the engine: decode tokens/s on the default model for 32 concurrent requests
without adapters and with 8 distinct rank-16 all-linear adapters, timed interleaved in one run.

    .venv/bin/python -m bench.engine_overhead [--repeats 3] [--prompt 32] [--tokens 32]
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.random_adapter import write_random_adapter
from inference_service.default_model import prepare_default_model
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams

REQUESTS, ADAPTERS, RANK = 32, 8, 16


def decode_rate(engine: Engine, adapters: list[str | None], prompt_len: int, tokens: int) -> float:
    """Generated tokens per second over the steps in which every request was decoding."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, adapter in enumerate(adapters):
        engine.submit(Request([100 + i] * prompt_len, adapter, params), lambda delta: None)
    decode_seconds = decoded = 0.0
    while engine.has_work:
        decoding = not engine.scheduler.waiting and not any(s.in_prefill for s in engine.scheduler.running)
        batch = len(engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            decode_seconds += time.perf_counter() - start
            decoded += batch
    return decoded / decode_seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = prepare_default_model(Path(os.environ.get("LORAMUX_CACHE", ".cache")))
    config = EngineConfig(
        model=str(model_dir),
        max_loras=ADAPTERS,
        max_lora_rank=RANK,
        max_cpu_loras=ADAPTERS,
        max_num_seqs=REQUESTS,
        kv_cache_tokens=REQUESTS * (args.prompt + args.tokens + 16),
    )
    engine = Engine(config)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ADAPTERS):
            folder = write_random_adapter(engine.runner.model_config, Path(tmp) / f"r16-{i}", RANK, seed=i)
            engine.add_adapter(folder.name, folder)
    cases = {"base": [None] * REQUESTS, "8 adapters": [f"r16-{i % ADAPTERS}" for i in range(REQUESTS)]}
    rates: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # round 0 warms up and is dropped
            for name, adapters in cases.items():
                rate = decode_rate(engine, adapters, args.prompt, args.tokens)
                if repeat:
                    rates[name].append(rate)
    # Each round times both cases back to back, so its ratio sees the same machine state.
    ratios = [lora / base for base, lora in zip(rates["base"], rates["8 adapters"], strict=True)]
    print(
        f"{REQUESTS} requests x ({args.prompt} prompt + {args.tokens} new tokens), default model, "
        f"torch threads {torch.get_num_threads()}, median of {args.repeats} rounds"
    )
    print(f"decode tok/s, no adapters:                      {statistics.median(rates['base']):8.1f}")
    print(
        f"decode tok/s, {ADAPTERS} distinct rank-{RANK} all-linear adapters: "
        f"{statistics.median(rates['8 adapters']):8.1f}"
    )
    print(
        f"ratio (target >= 0.90 on CPU):                  {statistics.median(ratios):8.3f}"
        f"   (rounds {min(ratios):.3f} .. {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()

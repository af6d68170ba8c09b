"""What tensor parallelism costs on the CPU: a random-weight Llama twice the default model's size
(bench/random_model.py LARGER_LLAMA: 24 heads, 8 KV heads, which 2 ranks split) in fp32 decoding
16 sequences over 8 distinct random rank-16 adapters on every module: on one rank with one thread,
on one rank with two, and on two ranks (processes) of one thread each, LoRA split with its layers
and fully sharded; and the share of rank 0's time spent in exchanges with the other rank. On a CPU
the ranks share the machine's cores and memory bandwidth: tensor parallelism is for a model larger
than one device's memory, not for speed. Each variant is an engine of its own, all alive at once
(an idle one's ranks wait without using a core); they run a round in turn, the order rotating;
medians of per-round ratios.

    .venv/bin/python -m bench.tensor_parallel [--repeats 3] [--steps 32]
"""

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.random_adapter import write_random_adapter
from bench.random_model import LARGER_LLAMA, larger_llama
from bench.rank_padding import decode_main
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig

SEQUENCES, ADAPTERS, RANK, PROMPT = 16, 8, 16, 16
STEPS = 32  # decode tokens per sequence in a round
ONE, SPLIT, FULLY = "1 rank, 1 thread", "2 ranks, LoRA split with its layers", "2 ranks, LoRA fully sharded"
BOTH_CORES = "1 rank, 2 threads"
# (ranks, fully sharded, rank 0's torch threads); every other rank runs one thread on 2 cores
VARIANTS = {ONE: (1, False, 1), BOTH_CORES: (1, False, 2), SPLIT: (2, False, 1), FULLY: (2, True, 1)}


def tensor_parallel(
    model_dir: Path, repeats: int = 3, progress: Callable[[str], None] = lambda line: None, steps: int = STEPS
) -> dict:
    """model_dir: the default model's folder; the larger Llama is written beside it once."""
    torch.set_num_threads(1)  # rank 0's thread; the other ranks take one each (the cores / ranks)
    model_dir = larger_llama(model_dir.parent)
    config = ModelConfig.from_dir(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [write_random_adapter(config, Path(tmp) / f"a{i}", RANK, seed=i) for i in range(ADAPTERS)]
        engines = {
            name: _engine(model_dir, adapters, size, fully) for name, (size, fully, _) in VARIANTS.items()
        }
    try:
        rounds = _rounds(engines, repeats, steps, progress)
    finally:
        for engine in engines.values():
            engine.stop()
    return summary(rounds, repeats, steps)


def _engine(model_dir: Path, adapters: list[Path], size: int, fully_sharded: bool) -> Engine:
    config = EngineConfig(
        model=str(model_dir),
        tensor_parallel_size=size,
        fully_sharded_loras=fully_sharded,
        max_loras=ADAPTERS,
        max_lora_rank=RANK,
        max_cpu_loras=ADAPTERS,
        max_num_seqs=SEQUENCES,
        kv_cache_tokens=SEQUENCES * 128,
        max_model_len=128,
    )
    engine = Engine(config)
    for i, folder in enumerate(adapters):
        engine.add_adapter(f"a{i}", folder)
    _generate(engine, 2)  # adapters into adapter memory, every rank warm
    return engine


def _generate(engine: Engine, steps: int) -> None:
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(PROMPT)] for i in range(SEQUENCES)]
    engine.generate([Request(p, f"a{i % ADAPTERS}", params) for i, p in enumerate(prompts)])


def _rounds(
    engines: dict[str, Engine], repeats: int, steps: int, progress
) -> dict[str, dict[str, list[float]]]:
    """Per variant: each round's seconds and its seconds in exchanges."""
    rounds = {name: {"seconds": [], "collective seconds": []} for name in engines}
    names = list(engines)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            engine = engines[name]
            torch.set_num_threads(VARIANTS[name][2])
            exchanged, start = engine.stats().collective_seconds, time.perf_counter()
            _generate(engine, steps)
            rounds[name]["seconds"].append(time.perf_counter() - start)
            torch.set_num_threads(1)
            rounds[name]["collective seconds"].append(engine.stats().collective_seconds - exchanged)
        progress(f"round {r + 1}/{repeats}")
    return rounds


def summary(rounds: dict[str, dict[str, list[float]]], repeats: int, steps: int) -> dict:
    one = rounds[ONE]["seconds"]
    ratios = {
        name: [base / seconds for base, seconds in zip(one, rounds[name]["seconds"], strict=True)]
        for name in rounds
    }
    table = []
    for name, measured in rounds.items():
        seconds = statistics.median(measured["seconds"])
        shares = [c / s for c, s in zip(measured["collective seconds"], measured["seconds"], strict=True)]
        table.append(
            {
                "variant": name,
                "s / round": round(seconds, 2),
                "tok/s": round(SEQUENCES * steps / seconds, 1),
                "tok/s vs 1 rank, 1 thread": round(statistics.median(ratios[name]), 3),
                "in exchanges": f"{statistics.median(shares):.0%}",
                "rounds min..max": f"{min(ratios[name]):.3f} .. {max(ratios[name]):.3f}",
            }
        )
    return {
        "setup": setup(repeats, steps),
        "table": table,
        "rounds": rounds,
        "ratios": ratios,
        "torch_threads": 1,  # each rank's
    }


def setup(repeats: int, steps: int) -> str:
    shape = LARGER_LLAMA
    return (
        f"A random-weight Llama (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads; float32) on the "
        f"CPU: {SEQUENCES} sequences of {PROMPT} prompt "
        f"tokens and {steps} generated ones each, over {ADAPTERS} distinct random rank-{RANK} adapters on "
        "every module, through the engine (prefill included), on 1 rank with 1 thread and with 2, and on 2 "
        "ranks (processes) with 1 thread each; 'in exchanges' is rank 0's time in collectives (waiting for "
        f"the other rank included) over the round's. Medians of {repeats} rounds, the ratio the median "
        "of per-round ratios"
    )


if __name__ == "__main__":
    decode_main(__doc__, tensor_parallel, STEPS)

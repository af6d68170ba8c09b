"""What LoRA on the vocabulary side costs decoding: decode tokens/s on the default model for 32
requests spread round-robin over 8 distinct random rank-16 all-linear adapters, 4 of which also
carry LoRA on embed_tokens and lm_head, beside the same 8 adapters without those parts (the same
linear weights). Each arm runs on its own engine and the engines take their steps in turn
(bench.engine_overhead), so both see the same machine state. An arm's tok/s in a round is 32 over
its median decode step (all 32 requests decoding): a median, as other processes' bursts on a
2-core machine slow some steps tenfold; the ratio is the median of per-round ratios. A first
round, dropped from the figures, runs each arm's requests to the end and compares their greedy
tokens: those on the 4 vocabulary adapters change, the others do not.

    .venv/bin/python -m bench.vocab_adapters [--repeats 5] [--prompt 16] [--tokens 64]
"""

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bench.cache import default_model_dir
from bench.engine_overhead import full_batch_steps, prompt_ids
from bench.random_adapter import write_random_adapter
from bench.report import markdown_table
from inference_service.adapters.adapter_image import AdapterImage
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.engine.adapter_memory import adapter_bytes
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter

REQUESTS, ADAPTERS, WITH_VOCAB, RANK = 32, 8, 4, 16
PROMPT, TOKENS = 16, 64
TARGET = 0.9  # the ratio the vocabulary side is meant to keep at least
PLAIN = "8 all-linear adapters"
VOCAB = "4 of them with embed_tokens + lm_head"
ARMS = (PLAIN, VOCAB)


def vocab_adapters(
    model_dir: Path,
    repeats: int = 5,
    progress: Callable[[str], None] = lambda line: None,
    prompt: int = PROMPT,
    tokens: int = TOKENS,
) -> dict:
    """Decode tok/s of each arm in `repeats` rounds after a dropped one, and how many requests'
    greedy tokens the vocabulary side changed."""
    model = ModelConfig.from_dir(model_dir)
    adapters = [f"a{i % ADAPTERS}" for i in range(REQUESTS)]
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"2 engines, {2 * ADAPTERS} random rank-{RANK} adapters")
        folders = {arm: write_adapters(model, Path(tmp) / str(n), arm == VOCAB) for n, arm in enumerate(ARMS)}
        one = vocab_adapter_bytes(model, folders[VOCAB][0])
        engines = {arm: engine(model_dir, ADAPTERS * one, prompt + tokens, folders[arm]) for arm in ARMS}
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with torch.inference_mode():
        progress("round 0 (dropped): greedy tokens of both arms")
        outputs = {arm: greedy_tokens(engines[arm], adapters, prompt, tokens) for arm in ARMS}
        for repeat in range(1, repeats + 1):
            order = ARMS if repeat % 2 else ARMS[::-1]  # who steps first
            runs = [(engines[arm], adapters) for arm in order]
            for arm, steps in zip(order, decode_steps(runs, prompt, tokens), strict=True):
                rates[arm].append(REQUESTS / statistics.median(steps))
            progress(
                f"round {repeat}/{repeats}: " + ", ".join(f"{a} {r[-1]:.1f} tok/s" for a, r in rates.items())
            )
    for e in engines.values():
        e.stop()
    return summary(rates, changed(outputs), one, repeats, prompt, tokens)


def write_adapters(model: ModelConfig, root: Path, vocab: bool) -> list[Path]:
    """Adapters a0 .. a7; with `vocab`, a0 .. a3 also on embed_tokens and lm_head (the same seeds:
    the same linear weights either way)."""
    return [
        write_random_adapter(model, root / f"a{i}", RANK, seed=i, vocab=vocab and i < WITH_VOCAB)
        for i in range(ADAPTERS)
    ]


def vocab_adapter_bytes(model: ModelConfig, folder: Path) -> int:
    """Bytes of adapter memory the adapter in `folder` takes, its vocabulary side's run included."""
    weights = load_peft_adapter(folder.name, folder, model, RANK, torch.float32)
    return adapter_bytes(model, AdapterImage.of(weights, model, torch.float32).need, torch.float32)


def engine(model_dir: Path, memory: int, length: int, folders: list[Path]) -> Engine:
    """An engine whose adapter memory (`memory` bytes) and host tier hold all of `folders`."""
    config = EngineConfig(
        model=str(model_dir),
        max_loras=ADAPTERS,
        max_lora_rank=RANK,
        adapter_memory=memory,
        max_cpu_loras=ADAPTERS,
        max_num_seqs=REQUESTS,
        max_model_len=length + 16,
        kv_cache_tokens=REQUESTS * (length + 16),
    )
    e = Engine(config)
    for folder in folders:
        e.add_adapter(folder.name, folder)
    return e


def decode_steps(runs: list[tuple[Engine, list[str]]], prompt: int, tokens: int) -> list[list[float]]:
    """Seconds of each step in which all of an engine's requests decoded, for each (engine,
    adapters of its requests); the engines step in turn, one step each."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return full_batch_steps(
        [
            (e, [Request(prompt_ids(i, prompt), a, params) for i, a in enumerate(adapters)])
            for e, adapters in runs
        ]
    )


def greedy_tokens(e: Engine, adapters: list[str], prompt: int, tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    requests = [Request(prompt_ids(i, prompt), a, params) for i, a in enumerate(adapters)]
    return [out.token_ids for out in e.generate(requests)]


def changed(outputs: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """The requests whose greedy tokens differ between the arms, by whether their adapter has a
    vocabulary side in the vocabulary arm (request i runs on adapter i % ADAPTERS)."""
    differ = [i for i, (p, v) in enumerate(zip(outputs[PLAIN], outputs[VOCAB], strict=True)) if p != v]
    return {
        "vocab": [i for i in differ if i % ADAPTERS < WITH_VOCAB],
        "plain": [i for i in differ if i % ADAPTERS >= WITH_VOCAB],
    }


def summary(
    rates: dict[str, list[float]],
    changes: dict[str, list[int]],
    adapter_size: int,
    repeats: int,
    prompt: int,
    tokens: int,
) -> dict:
    """adapter_size: bytes of adapter memory one adapter with a vocabulary side takes."""
    ratios = [v / p for v, p in zip(rates[VOCAB], rates[PLAIN], strict=True)]
    on_vocab = REQUESTS * WITH_VOCAB // ADAPTERS
    table = [
        {"adapters": PLAIN, "decode tok/s": round(statistics.median(rates[PLAIN]), 1), "ratio to plain": 1.0},
        {
            "adapters": VOCAB,
            "decode tok/s": round(statistics.median(rates[VOCAB]), 1),
            "ratio to plain": round(statistics.median(ratios), 3),
            "ratio, rounds min..max": f"{min(ratios):.3f} .. {max(ratios):.3f}",
            "greedy tokens changed": (
                f"{len(changes['vocab'])} / {on_vocab} requests on vocabulary adapters, "
                f"{len(changes['plain'])} / {REQUESTS - on_vocab} on the others"
            ),
        },
    ]
    return {
        "setup": setup(adapter_size, repeats, prompt, tokens),
        "table": table,
        "decode_tok_s": rates,
        "ratios": ratios,
        "tokens_changed": changes,
        "target": TARGET,
        "torch_threads": torch.get_num_threads(),
    }


def setup(adapter_size: int, repeats: int, prompt: int, tokens: int) -> str:
    return (
        f"{REQUESTS} concurrent requests x ({prompt} prompt + {tokens} new tokens), greedy, default model "
        f"on the CPU, float32; {ADAPTERS} distinct random rank-{RANK} all-linear adapters spread "
        f"round-robin over the requests, and the same {ADAPTERS} (the same linear weights) of which "
        f"{WITH_VOCAB} also carry rank-{RANK} LoRA on embed_tokens and lm_head (so half the requests "
        f"use a vocabulary side); each arm on its own engine, with adapter memory for {ADAPTERS} "
        f"adapters with a vocabulary side ({adapter_size / 2**20:.1f} MiB each) in both; the engines "
        f"take their steps in turn, one step each, so both arms see the same machine state; an arm's "
        f"tok/s in a round is {REQUESTS} over its median decode step; medians of {repeats} rounds "
        f"after a dropped round that also compares the arms' greedy tokens. Target: a ratio of at "
        f"least {TARGET}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=PROMPT)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    args = parser.parse_args()
    result = vocab_adapters(default_model_dir(), args.repeats, print, args.prompt, args.tokens)
    print(result["setup"] + f"; torch threads {result['torch_threads']}.")
    print(markdown_table(result["table"]))


if __name__ == "__main__":
    main()

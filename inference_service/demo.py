"""`make run` until the services exist: greedy generation on the default model, several prompts
in one batch through the runtime (prefill together, then one decode step for all per token)."""

import os
import time
from pathlib import Path

import torch

from inference_service.config import EngineConfig
from inference_service.default_model import prepare_default_model
from inference_service.forward_batch import SequenceInput
from inference_service.kv_cache import BlockAllocator
from inference_service.model_runner import ModelRunner
from inference_service.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


def greedy_generate(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: int, stop_ids: tuple[int, ...]
) -> list[list[int]]:
    """Greedy continuations of all prompts, batched; each stops at max_tokens or a stop id."""
    block_size = runner.config.block_size
    allocator = BlockAllocator(runner.cache.num_blocks)
    tables = [allocator.allocate(-(-(len(p) + max_tokens) // block_size)) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    inputs = [SequenceInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    active = list(range(len(prompts)))
    while active:
        next_ids = runner.forward(inputs).argmax(dim=-1).tolist()
        for i, token in zip(active, next_ids, strict=True):
            outputs[i].append(token)
        active = [i for i in active if outputs[i][-1] not in stop_ids and len(outputs[i]) < max_tokens]
        inputs = [
            SequenceInput([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i]) for i in active
        ]
    return outputs


def main() -> None:
    cache = Path(os.environ.get("LORAMUX_CACHE", ".cache"))
    print(f"preparing the default model (SmolLM2-135M-Instruct) under {cache} ...", flush=True)
    model_dir = prepare_default_model(cache)
    runner = ModelRunner(EngineConfig(model=str(model_dir), kv_cache_tokens=2048))
    tokenizer = Tokenizer.from_dir(model_dir)
    texts = [*PROMPTS, tokenizer.apply_chat_template(CHAT)]
    start = time.perf_counter()
    with torch.inference_mode():
        outputs = greedy_generate(runner, [tokenizer.encode(t) for t in texts], 24, tokenizer.eos_token_ids)
    elapsed = time.perf_counter() - start
    for text, out in zip(texts, outputs, strict=True):
        print(f"\n>>> {text!r}\n{tokenizer.decode(out, skip_special_tokens=True)}")
    total = sum(map(len, outputs))
    rate = total / elapsed
    print(f"\n{len(texts)} requests in one batch: {total} tokens in {elapsed:.2f} s ({rate:.1f} tok/s)")


if __name__ == "__main__":
    main()

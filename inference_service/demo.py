"""`make run` until the services exist: several requests in one continuous batch on the default
model through the engine, streamed to the terminal as they decode."""

import os
import time
from pathlib import Path

from inference_service.default_model import prepare_default_model
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


def main() -> None:
    cache = Path(os.environ.get("LORAMUX_CACHE", ".cache"))
    print(f"preparing the default model (SmolLM2-135M-Instruct) under {cache} ...", flush=True)
    engine = Engine(EngineConfig(model=str(prepare_default_model(cache)), kv_cache_tokens=2048))
    tokenizer = engine.tokenizer
    texts = [*PROMPTS, tokenizer.apply_chat_template(CHAT)]
    params = SamplingParams(max_tokens=24, temperature=0)
    requests = [Request(tokenizer.encode(t), params=params, request_id=f"r{i}") for i, t in enumerate(texts)]
    start = time.perf_counter()
    outputs = engine.generate(requests)
    elapsed = time.perf_counter() - start
    for text, out in zip(texts, outputs, strict=True):
        print(f"\n>>> {text!r}\n{out.text}   [{out.finish_reason}]")
    total = sum(o.completion_tokens for o in outputs)
    rate = total / elapsed
    print(f"\n{len(texts)} requests in one batch: {total} tokens in {elapsed:.2f} s ({rate:.1f} tok/s)")


if __name__ == "__main__":
    main()

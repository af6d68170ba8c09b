"""Where a decode step's time goes: torch.profiler over decode steps of 32 requests on the default
model, without adapters and with N distinct rank-16 all-linear adapters, printing the ops by self
CPU time. This is the profile behind the LoRA overhead figure.

    .venv/bin/python -m bench.profile_decode [--adapters 8] [--steps 8] [--rows 15] [--dtype bfloat16]
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.cache import default_model_dir
from bench.engine_overhead import REQUESTS, engines_with_adapters, prompt_ids
from inference_service.engine import Engine, Request
from inference_service.sampling import SamplingParams
from shared.dtypes import DTYPES

PROMPT = 32


def start_decoding(engine: Engine, adapters: list[str | None], prompt: int, tokens: int) -> None:
    """Submits a request of `prompt` tokens and `tokens` new ones for each entry of `adapters`,
    then steps until every request has taken its first decode step."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, adapter in enumerate(adapters):
        engine.submit(Request(prompt_ids(i, prompt), adapter, params), lambda delta: None)
    engine.step()  # admits them: submit only queues them for the next step
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode step, kept out of what the caller measures


def median_step_seconds(engine: Engine, steps: int) -> float:
    """The median of `steps` engine steps' seconds, each timed alone."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step_seconds(engine: Engine, adapters: list[str | None], prompt: int, steps: int) -> float:
    """The median of `steps` decode steps of one request per entry of `adapters`, taken once
    every request decodes; then the requests run out. The first admitted decode a token in each
    step that prefills the rest, so each asks for that many tokens more than the steps timed."""
    prefill_steps = -(-len(adapters) * prompt // engine.config.max_num_batched_tokens)
    start_decoding(engine, adapters, prompt, steps + 2 + prefill_steps)
    seconds = median_step_seconds(engine, steps)
    while engine.has_work:
        engine.step()
    return seconds


def timed_prefill(engine: Engine, adapters: list[str | None], prompt: int) -> tuple[float, list[list[int]]]:
    """Seconds to prefill one `prompt`-token prompt per entry of `adapters` and draw one token
    each, and those tokens."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    requests = [Request(prompt_ids(i, prompt), adapter, params) for i, adapter in enumerate(adapters)]
    start = time.perf_counter()
    outputs = engine.generate(requests)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def alternate(arms: dict, rounds: int, measure) -> dict[str, list]:
    """measure(arms[arm]) for each arm, `rounds` times, the order reversed every other round."""
    results: dict[str, list] = {arm: [] for arm in arms}
    for round_ in range(rounds):
        for arm in list(arms)[:: 1 if round_ % 2 == 0 else -1]:
            results[arm].append(measure(arms[arm]))
    return results


def decode_profile(engine: Engine, adapters: list[str | None], steps: int) -> profile:
    """Profiles `steps` decode steps, taken once every request has its first token."""
    start_decoding(engine, adapters, PROMPT, steps + 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_work:
        engine.step()
    return prof


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    model_dir = default_model_dir()
    counts = (0, args.adapters)
    kv_tokens = REQUESTS * (PROMPT + args.steps + 16)
    engines = engines_with_adapters(model_dir, counts, kv_tokens, print, args.dtype)
    with torch.inference_mode():
        for n in counts:
            adapters = [f"r16-{i % n}" if n else None for i in range(REQUESTS)]
            decode_profile(engines[n], adapters, 2)  # warm-up
            prof = decode_profile(engines[n], adapters, args.steps)
            print(f"\n{n} adapters, {REQUESTS} requests, {args.steps} decode steps:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

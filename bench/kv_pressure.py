"""KV memory under pressure, on the default model: blocks taken as requests grow (and preemption
when they outgrow the cache) against blocks reserved for prompt + max_tokens at admission.

Early stops. REQUESTS requests, each a 512-token prompt with max_tokens 1024, arrive at once and
end when their output reaches a length drawn from 48..80 (as an end-of-sequence token ends a chat
answer long before max_tokens; the run ends each request there itself, so both cases generate
the same tokens). The KV cache holds RESERVATIONS requests' prompt + max_tokens. The reserving
side is the same engine with max_num_seqs at RESERVATIONS: all a reservation admits, and it
never preempts. The two sides run in lock step, one engine step each in turn. Figures per round:
running requests per step (mean) and generated tokens/s over each side's own step time.

Every request to max_tokens. OVERSUBSCRIBED requests of 128-token prompts, max_tokens 256 and
no early end, in a cache of a third of what they need at once: every one finishes, every step
computes something, and preempted requests are preempted few times each.

    LORAMUX_CACHE=.cache .venv/bin/python -m bench.kv_pressure [--repeats 2]
"""

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.cache import default_model_dir
from bench.report import markdown_table
from inference_service.engine import Delta, Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams

BLOCK = 16
REQUESTS, PROMPT, MAX_TOKENS, ENDS = 48, 512, 1024, (48, 80)
RESERVATIONS = 4  # requests whose prompt + max_tokens the cache holds
OVERSUBSCRIBED, LONG_PROMPT, LONG_TOKENS = 12, 128, 256
RESERVING, ON_DEMAND = "reserving prompt + max_tokens", "blocks on demand"


@dataclass(frozen=True)
class Run:
    seconds: float
    tokens: int  # generated
    running: list[int]  # requests running after each step
    computed: list[int]  # tokens each step computed
    decode_seconds: float  # in steps that computed one token per request, no prompt chunk
    preemptions: list[int]  # per request

    def row(self) -> dict[str, float]:
        return {
            "tok/s": self.tokens / self.seconds,
            "running per step": statistics.fmean(self.running),
            "decode tok/s": self.tokens / self.decode_seconds,
        }


def engine(model_dir, kv_tokens: int, max_num_seqs: int, max_model_len: int) -> Engine:
    config = EngineConfig(
        model=str(model_dir),
        kv_cache_tokens=kv_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    return Engine(config)


class Driven:
    """One engine running `requests`, stepped from outside; a request with an end is aborted once
    its output reaches it. Counts its own step time, the tokens each step computed, and the time
    in decode-only steps (around the runner)."""

    def __init__(self, eng: Engine, requests: list[Request], ends: list[int] | None):
        self.eng, self.seconds, self.decode_seconds = eng, 0.0, 0.0
        self.outputs: dict[str, list[Delta]] = {r.request_id: [] for r in requests}
        self.computed: list[int] = []  # per engine step, 0 when it ran nothing
        self.running: list[int] = []
        self._run_chunks = eng.runner.run
        eng.runner.run = self._counting_run
        for i, request in enumerate(requests):
            eng.submit(request, self._sink(request.request_id, ends[i] if ends else None))

    def _sink(self, rid: str, end: int | None) -> Callable[[Delta], None]:
        def sink(delta: Delta) -> None:
            self.outputs[rid].append(delta)
            if end is not None and sum(len(d.token_ids) for d in self.outputs[rid]) == end:
                self.eng.abort(rid)

        return sink

    def _counting_run(self, chunks):
        self.computed[-1] += sum(c.num_tokens for c in chunks)
        start = time.perf_counter()
        out = self._run_chunks(chunks)
        if all(c.num_tokens == 1 for c in chunks):
            self.decode_seconds += time.perf_counter() - start
        return out

    @property
    def done(self) -> bool:
        return all(d and d[-1].finish_reason is not None for d in self.outputs.values())

    def step(self) -> None:
        self.computed.append(0)
        start = time.perf_counter()
        self.eng.step()
        self.seconds += time.perf_counter() - start
        self.running.append(len(self.eng.scheduler.running))

    def result(self) -> Run:
        self.eng.runner.run = self._run_chunks
        tokens = sum(len(delta.token_ids) for deltas in self.outputs.values() for delta in deltas)
        preemptions = [deltas[-1].preemptions for deltas in self.outputs.values()]
        return Run(self.seconds, tokens, self.running, self.computed, self.decode_seconds, preemptions)


def drive(engines: dict[str, Engine], requests: list[Request], ends: list[int] | None) -> dict[str, Run]:
    """The same requests on every engine, the engines taking one step each in turn, so the
    machine's drift reaches them alike; each one's figures over its own step time."""
    driven = {side: Driven(eng, requests, ends) for side, eng in engines.items()}
    while not all(d.done for d in driven.values()):
        for d in driven.values():
            if not d.done:
                d.step()
    return {side: d.result() for side, d in driven.items()}


def early_stops(round_: int, vocab: int) -> tuple[list[Request], list[int]]:
    rng = random.Random(round_)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    requests = [
        Request([rng.randrange(17, vocab) for _ in range(PROMPT)], None, params, f"r{round_}-{i}")
        for i in range(REQUESTS)
    ]
    return requests, [rng.randint(*ENDS) for _ in requests]


def every_token(vocab: int) -> list[Request]:
    rng = random.Random(99)
    params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True)
    return [
        Request([rng.randrange(17, vocab) for _ in range(LONG_PROMPT)], None, params, f"long-{i}")
        for i in range(OVERSUBSCRIBED)
    ]


def kv_pressure(model_dir, repeats: int = 2, progress: Callable[[str], None] = lambda line: None) -> dict:
    kv_tokens = RESERVATIONS * -(-(PROMPT + MAX_TOKENS) // BLOCK) * BLOCK
    engines = {
        RESERVING: engine(model_dir, kv_tokens, RESERVATIONS, PROMPT + MAX_TOKENS),
        ON_DEMAND: engine(model_dir, kv_tokens, 32, PROMPT + MAX_TOKENS),
    }
    vocab = engines[ON_DEMAND].model_config.vocab_size
    rounds: dict[str, list[Run]] = {side: [] for side in engines}
    with torch.inference_mode():
        for repeat in range(1, repeats + 1):
            requests, ends = early_stops(repeat, vocab)
            for side, run in drive(engines, requests, ends).items():
                rounds[side].append(run)
                progress(f"round {repeat}, {side}: {brief(run)}")
        demand = OVERSUBSCRIBED * (LONG_PROMPT + LONG_TOKENS)
        oversubscribed = engine(model_dir, demand // 3, 32, LONG_PROMPT + LONG_TOKENS)
        long_run = drive({"oversubscribed": oversubscribed}, every_token(vocab), None)["oversubscribed"]
        progress(f"every request to max_tokens, a cache of a third: {brief(long_run)}")
    return summary(rounds, long_run, repeats, kv_tokens)


def brief(run: Run) -> str:
    row = run.row()
    return (
        f"{row['tok/s']:.1f} tok/s ({row['decode tok/s']:.1f} in decode-only steps), "
        f"{row['running per step']:.2f} running per step over {len(run.running)} steps, "
        f"{sum(run.preemptions)} preemptions"
    )


def summary(rounds: dict[str, list[Run]], long_run: Run, repeats: int, kv_tokens: int) -> dict:
    keys = ("tok/s", "decode tok/s", "running per step")
    table = [
        {
            "case": f"early stops, {side}",
            **{key: round(statistics.median(run.row()[key] for run in runs), 2) for key in keys},
            "preemptions": sum(sum(run.preemptions) for run in runs),
        }
        for side, runs in rounds.items()
    ]
    ratios = {
        key: [d.row()[key] / r.row()[key] for d, r in zip(rounds[ON_DEMAND], rounds[RESERVING], strict=True)]
        for key in keys
    }
    table.append(
        {
            "case": "early stops, on demand / reserving",
            **{key: round(statistics.median(values), 2) for key, values in ratios.items()},
            "preemptions": "",
        }
    )
    preempted = [p for p in long_run.preemptions if p]
    table.append(
        {
            "case": f"every request to max_tokens, a cache of 1/3: {len(long_run.preemptions)} finished",
            **{key: round(long_run.row()[key], 2) for key in keys},
            "preemptions": f"{len(preempted)} requests, {statistics.fmean(preempted or [0]):.2f} each",
        }
    )
    return {
        "setup": setup(repeats, kv_tokens),
        "table": table,
        "ratios": ratios,
        "running": {side: runs[-1].running for side, runs in rounds.items()},
        "long_run": {
            "running": long_run.running,
            "steps_without_progress": sum(1 for c in long_run.computed if c == 0),
            "preemptions": long_run.preemptions,
        },
        "torch_threads": torch.get_num_threads(),
    }


def setup(repeats: int, kv_tokens: int) -> str:
    return (
        f"Default model on the CPU, float32, distinct prompts (the prefix cache serves only a "
        f"preempted request's own blocks back). Early stops: {REQUESTS} requests of {PROMPT}-token "
        f"prompts with max_tokens {MAX_TOKENS}, arriving at once, each ended when its output reaches "
        f"a length drawn from {ENDS[0]}..{ENDS[1]} (as an end-of-sequence token would end it), in a "
        f"KV cache of {kv_tokens} positions: {RESERVATIONS} requests' prompt + max_tokens. The "
        f"reserving side is the same engine admitting at most {RESERVATIONS} at once, as "
        f"reservations do. The sides step in turn, each timed over its own steps; decode tok/s: "
        f"tokens over the time in steps without prompt chunks (both sides compute the same "
        f"prompts). Medians of {repeats} rounds; ratios are medians of per-round ratios. Every "
        f"request to max_tokens: "
        f"{OVERSUBSCRIBED} requests of {LONG_PROMPT}-token prompts and {LONG_TOKENS} new tokens "
        f"each, in a cache of a third of their positions"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    result = kv_pressure(default_model_dir(), args.repeats, print)
    print(result["setup"] + f"; torch threads {result['torch_threads']}.")
    print(markdown_table(result["table"]))
    idle = result["long_run"]["steps_without_progress"]
    print(f"steps without progress, every request to max_tokens: {idle}")


if __name__ == "__main__":
    main()

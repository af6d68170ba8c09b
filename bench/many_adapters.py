"""Many adapters: generated tokens/s of a saturated engine (its queue kept 2 x max_num_seqs deep)
whose requests name 1,000 registered adapters of ranks 8 to 64 with Zipf(1.0) popularity, against
the same requests over 8 hot adapters, on the default model, in the adapter memory 8 rank-16
slots on every module took; beside it the whole round's rate (its queue draining out at the end),
the host tier's hit rate, the adapter loads and the activations of each run.

Every adapter is registered by name, folder and content digest, read once beforehand as the
adapter store reads each at its registration; the host tier loads (validates, optimizes) one from
disk in the background when a request first names it, and keeps the 64 most recently used. Both
cases run on engines built once; the timed rounds see the host tier warm from the rounds before
them (a server's steady state), the dropped warm-up round sees it cold.

    LORAMUX_CACHE=.cache .venv/bin/python -m bench.many_adapters [--repeats 2]
"""

import argparse
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from bench.cache import default_model_dir
from bench.random_adapter import write_random_adapter
from bench.report import markdown_table
from inference_service.adapters.host_tier import LOAD_THREADS
from inference_service.engine import Delta, Engine, EngineConfig, Request
from inference_service.engine.adapter_memory import slot_memory
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig

ADAPTERS, HOT, ZIPF_S = 1000, 8, 1.0
RANKS, TARGETS = (8, 16, 32, 64), ("q_proj", "v_proj")  # each adapter's rank drawn from RANKS
REQUESTS, PROMPT, MIN_NEW, MAX_NEW = 192, 16, 16, 32
MAX_LORA_RANK, MAX_CPU_LORAS, MAX_NUM_SEQS = max(RANKS), 64, 32
QUEUE = 2 * MAX_NUM_SEQS  # requests kept waiting beyond the running ones while a round submits
# steps of one case before the other's turn: long enough that waiting for its loads at the end of
# its block is a small share of its time
BLOCK_STEPS = 24
MEMORY_OF = (8, 16)  # adapter memory: what this many slots of this rank took on every module
ZIPF, HOT_CASE = f"{ADAPTERS:,} adapters, Zipf({ZIPF_S})", f"{HOT} hot adapters"


@dataclass(frozen=True)
class Workload:
    """One round's requests; both cases send the same prompts and lengths."""

    prompts: list[list[int]]
    new_tokens: list[int]
    adapters: dict[str, list[str]]  # case -> adapter of each request


def zipf_draws(count: int, n: int, s: float, seed: int) -> list[int]:
    """`count` indices in [0, n), index k drawn with probability proportional to 1 / (k + 1)^s."""
    weights = 1 / np.arange(1, n + 1) ** s
    return np.random.default_rng(seed).choice(n, size=count, p=weights / weights.sum()).tolist()


def workload(seed: int, vocab_size: int) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab_size, size=(REQUESTS, PROMPT)).tolist()
    new_tokens = rng.integers(MIN_NEW, MAX_NEW + 1, size=REQUESTS).tolist()
    popular = zipf_draws(REQUESTS, ADAPTERS, ZIPF_S, seed)
    adapters = {ZIPF: [f"a{i}" for i in popular], HOT_CASE: [f"a{i % HOT}" for i in range(REQUESTS)]}
    return Workload(prompts, new_tokens, adapters)


def write_adapters(model: ModelConfig, root: Path, progress: Callable[[str], None]) -> list[Path]:
    """ADAPTERS random adapters a0 .. a999, each of distinct content (its own seed) and of a rank
    drawn uniformly from RANKS."""
    start = time.perf_counter()
    ranks = np.random.default_rng(ADAPTERS).choice(RANKS, size=ADAPTERS).tolist()
    folders = [write_random_adapter(model, root / f"a{i}", ranks[i], i, TARGETS) for i in range(ADAPTERS)]
    megabytes = sum(f.stat().st_size for d in folders for f in d.iterdir()) / 1e6
    progress(f"wrote {ADAPTERS} adapters ({megabytes:.0f} MB) in {time.perf_counter() - start:.1f} s")
    return folders


def engine_with(model_dir: Path, folders: list[Path]) -> Engine:
    """An engine on which every folder is registered by name and content digest (read here, as
    the store would): the host tier holds none until a request names it and it loads it in the
    background."""
    memory = slot_memory(ModelConfig.from_dir(model_dir), *MEMORY_OF, torch.float32)
    config = EngineConfig(
        model=str(model_dir),
        max_lora_rank=MAX_LORA_RANK,
        adapter_memory=memory,
        max_cpu_loras=MAX_CPU_LORAS,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=PROMPT + MAX_NEW + 16,
        kv_cache_tokens=MAX_NUM_SEQS * (PROMPT + MAX_NEW + 16),
    )
    engine = Engine(config)
    for folder in folders:
        engine.loader.register(folder.name, folder, engine.loader.read(folder.name, folder).digest)
    return engine


def counters(engine: Engine) -> dict[str, float]:
    stats = engine.stats()
    return {
        "tokens": stats.generation_tokens,
        "hits": stats.host_tier.hits,
        "misses": stats.host_tier.misses,
        "host evictions": stats.host_tier.evictions,
        "activations": stats.slots.activations,
        "load seconds": stats.adapter_load_seconds.total,
    }


@dataclass(frozen=True)
class StepRecord:
    start_s: float  # since the round's first submit
    end_s: float
    tokens: int
    adapters: tuple[str, ...]  # the adapter of each request that got tokens
    saturated: bool  # requests were still left to submit: the queue stayed QUEUE deep


class CaseRound:
    """One case's round on its engine, run in blocks of steps, so that both cases' rounds
    interleave block by block and see the same drift of the machine. Between blocks the engine
    is paused with no load in flight: a block ends by waiting for the loads its steps started,
    and that wait is the case's time too. Every time is on the case's own clock (its blocks).

    Keeps QUEUE requests waiting beyond the max_num_seqs running (one submitted as each ends)
    until every request is submitted, then steps the engine until all have ended."""

    def __init__(self, engine: Engine, adapters: list[str], load: Workload):
        self.engine, self.adapters = engine, adapters
        self.held = set(engine.held_digests())  # adapter names ready in the host tier
        self.before = counters(engine)
        self.todo = deque(zip(adapters, load.prompts, load.new_tokens, strict=True))
        self.seen: list[tuple[str, int, bool]] = []  # (adapter, tokens, ended) of each delta of the step
        self.steps: list[StepRecord] = []
        self.in_flight, self.clock, self.waited = 0, 0.0, 0.0  # waited: for loads, at block ends

    @property
    def done(self) -> bool:
        return not self.todo and not self.engine.has_work

    def block(self, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            if self.done:
                break
            self._step(lambda: self.clock + time.perf_counter() - start)
        waiting = time.perf_counter()
        self.engine.host.wait_for_loads()
        self.waited += time.perf_counter() - waiting
        self.clock += time.perf_counter() - start

    def _step(self, now: Callable[[], float]) -> None:
        while self.todo and self.in_flight < MAX_NUM_SEQS + QUEUE:
            adapter, prompt, n = self.todo.popleft()
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            self.engine.submit(Request(prompt, adapter, params), recorder(self.seen, adapter))
            self.in_flight += 1
        step_start = now()
        self.engine.step()
        ran = tuple(adapter for adapter, n, _ in self.seen if n)
        step_tokens = sum(n for _, n, _ in self.seen)
        self.steps.append(StepRecord(step_start, now(), step_tokens, ran, bool(self.todo)))
        self.in_flight -= sum(ended for *_, ended in self.seen)
        self.seen.clear()

    def result(self) -> dict[str, float]:
        steps, adapters = self.steps, self.adapters
        delta = {key: value - self.before[key] for key, value in counters(self.engine).items()}
        return {
            **window([s for s in steps if s.saturated], ""),
            **window(steps, "round "),
            "hit rate": delta["hits"] / (delta["hits"] + delta["misses"]),
            "requests held": sum(a in self.held for a in adapters) / len(adapters),
            "loads": delta["misses"],  # every miss starts one load
            "reloads": delta["misses"] - len(set(adapters) - self.held),
            "distinct adapters": len(set(adapters)),
            "activations": delta["activations"],
            "host evictions": delta["host evictions"],
            "load ms": 1e3 * delta["load seconds"] / max(delta["misses"], 1),
            "idle s": sum(s.end_s - s.start_s for s in steps if not s.adapters),
            "load wait s": self.waited,
        }


def run_interleaved(engines: dict[str, Engine], load: Workload, first: str) -> dict[str, dict[str, float]]:
    """Both cases' rounds, BLOCK_STEPS steps of each in turn, `first` first, until both end."""
    rounds = {case: CaseRound(engines[case], load.adapters[case], load) for case in engines}
    order = [first] + [case for case in rounds if case != first]
    while not all(r.done for r in rounds.values()):
        for case in order:
            rounds[case].block(BLOCK_STEPS)
    return {case: r.result() for case, r in rounds.items()}


def window(steps: list[StepRecord], prefix: str) -> dict[str, float]:
    """tok/s over the steps (from the round's first submit to the last one's end), requests that
    got tokens and their distinct adapters per step that ran any (a prompt fits one step, so
    every running request gets a token; a step that ran none waited for loads)."""
    ran = [s for s in steps if s.adapters]
    return {
        f"{prefix}tok/s": sum(s.tokens for s in steps) / steps[-1].end_s,
        f"{prefix}seconds": steps[-1].end_s,
        f"{prefix}running per step": statistics.mean(len(s.adapters) for s in ran),
        f"{prefix}adapters per step": statistics.mean(len(set(s.adapters)) for s in ran),
    }


def recorder(seen: list[tuple[str, int, bool]], adapter: str) -> Callable[[Delta], None]:
    return lambda delta: seen.append((adapter, len(delta.token_ids), delta.finish_reason is not None))


def many_adapters(
    model_dir: Path, repeats: int = 2, progress: Callable[[str], None] = lambda line: None
) -> dict:
    """Both cases once per round, each round starting at the other case, after a dropped warm-up
    round of the same requests cut to 1 new token (the hot engine loads its 8 adapters then, the
    Zipf engine's host tier starts filling)."""
    model = ModelConfig.from_dir(model_dir)
    rounds: dict[str, list[dict[str, float]]] = {ZIPF: [], HOT_CASE: []}
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        folders = write_adapters(model, Path(tmp), progress)
        engines = {ZIPF: engine_with(model_dir, folders), HOT_CASE: engine_with(model_dir, folders[:HOT])}
        for repeat in range(repeats + 1):
            load = workload(repeat, model.vocab_size)
            load = load if repeat else replace(load, new_tokens=[1] * REQUESTS)
            results = run_interleaved(engines, load, ZIPF if repeat % 2 == 0 else HOT_CASE)
            for case, result in results.items():
                progress(f"{'round ' + str(repeat) if repeat else 'warm-up'}, {case}: {brief(result)}")
                if repeat:
                    rounds[case].append(result)
        for engine in engines.values():
            engine.stop()
    return summary(rounds, repeats)


def brief(result: dict[str, float]) -> str:
    return (
        f"{result['tok/s']:.1f} tok/s saturated ({result['round tok/s']:.1f} over the whole "
        f"{result['round seconds']:.1f} s), hit rate {result['hit rate']:.3f}, "
        f"{result['loads']} loads ({result['reloads']} repeated, {result['load ms']:.0f} ms each), "
        f"{result['activations']} activations, {result['running per step']:.1f} running over "
        f"{result['adapters per step']:.1f} adapters per saturated step "
        f"({result['round running per step']:.1f} over the round), {result['idle s']:.2f} s idle, "
        f"{result['load wait s']:.2f} s waiting for loads at block ends"
    )


def summary(rounds: dict[str, list[dict[str, float]]], repeats: int) -> dict:
    """Medians over rounds; the Zipf case's ratios to hot are medians of per-round ratios."""
    ratios = {
        key: [z[key] / h[key] for z, h in zip(rounds[ZIPF], rounds[HOT_CASE], strict=True)]
        for key in ("tok/s", "round tok/s", "running per step")
    }

    def median(case: str, key: str, digits: int = 1) -> float:
        return round(statistics.median(r[key] for r in rounds[case]), digits)

    def ratio(case: str, key: str) -> float:
        return round(statistics.median(ratios[key]), 3) if case == ZIPF else 1.0

    table = [
        {
            "case": case,
            "tok/s, saturated": median(case, "tok/s"),
            "ratio to hot": ratio(case, "tok/s"),
            "running / step": median(case, "running per step"),
            "its ratio to hot": ratio(case, "running per step"),
            "adapters / step": median(case, "adapters per step"),
            "tok/s, whole round": median(case, "round tok/s"),
            "whole round, ratio to hot": ratio(case, "round tok/s"),
            "host-tier hit rate": median(case, "hit rate", 3),
            "requests whose adapter was held": median(case, "requests held", 3),
            "distinct adapters": median(case, "distinct adapters"),
            "adapter loads": median(case, "loads"),
            "repeated loads": median(case, "reloads"),
            "ms / load": median(case, "load ms"),
            "activations": median(case, "activations"),
            "idle s": median(case, "idle s", 2),
            "block-end load wait s": median(case, "load wait s", 2),
        }
        for case in rounds
    ]
    return {
        "setup": setup(repeats),
        "table": table,
        "rounds": rounds,
        "ratio_to_hot": ratios["tok/s"],
        "round_ratio_to_hot": ratios["round tok/s"],
        "torch_threads": torch.get_num_threads(),
    }


def setup(repeats: int) -> str:
    return (
        f"Default model on the CPU, float32. {ADAPTERS:,} random PEFT adapters of distinct content, "
        f"each of a rank drawn uniformly from {RANKS} on {' and '.join(TARGETS)} of every layer, "
        f"written to a temporary folder (so read from the page cache) and registered by name, folder "
        f"and content digest (each read once beforehand, as the adapter store reads it at its "
        f"registration): the host tier loads one (read, validate, optimize) on its {LOAD_THREADS} "
        f"background threads when a request first names it. Engine: adapter memory of "
        f"{MEMORY_OF[0]} rank-{MEMORY_OF[1]} adapters on every module (what {MEMORY_OF[0]} slots of "
        f"rank {MEMORY_OF[1]} took before paging), max_lora_rank={MAX_LORA_RANK}, "
        f"max_cpu_loras={MAX_CPU_LORAS} adapters in the host tier, max_num_seqs={MAX_NUM_SEQS}. "
        f"A round is {REQUESTS} requests, each a {PROMPT}-token random prompt and {MIN_NEW}..{MAX_NEW} "
        f"new tokens (greedy, EOS ignored), submitted so that {QUEUE} wait beyond the {MAX_NUM_SEQS} "
        f"running (one more as each ends) until all are submitted: a saturated server, whose queue "
        f"deeper than max_num_seqs lets the scheduler fill a step with requests whose adapters are in "
        f"device memory. The Zipf case draws each request's adapter with p(k) proportional to 1/k over "
        f"the {ADAPTERS:,}; the hot case sends the same prompts and lengths to the {HOT} most popular "
        f"adapters in turn. Saturated tok/s is the tokens generated from the first submit to the end "
        f"of the last step run while requests were left to submit, over that time, background loads "
        f"included; the whole round adds the last {MAX_NUM_SEQS + QUEUE} requests draining out, when "
        f"the queue empties (the Zipf case ends on requests of rare adapters, which wait for adapter "
        f"memory while those of resident adapters go ahead). Running / step and adapters / step count "
        f"the requests that got a token in a saturated step and their distinct adapters, averaged "
        f"over steps. The host-tier hit rate is the engine's counter, hits / (hits + misses), which "
        f"counts every admission check (a request waiting for device memory counts a hit at each step "
        f"it waits); 'requests whose adapter was held' is the share of requests whose adapter was ready "
        f"in the host tier when the round began. Repeated loads are loads beyond one per adapter that "
        f"was not held; ms / load is a load's mean time on its thread; idle s is the time of steps in "
        f"which nothing could run; block-end load wait s is the time the case's blocks spent at their "
        f"ends waiting for its loads (below). Each case has its own engine, built once: a dropped "
        f"warm-up round "
        f"(the same requests cut to 1 new token) loads the hot adapters and starts filling the Zipf "
        f"host tier, and each timed round (new Zipf draws) finds the host tier as the rounds before "
        f"left it, a running server's steady state. Medians of {repeats} rounds. A round runs both "
        f"cases interleaved, {BLOCK_STEPS} steps of one and then {BLOCK_STEPS} of the other (the first "
        f"case alternating between rounds), so both see the same drift of the machine: between its "
        f"blocks an engine is paused with no load in flight, a block ending with the wait for the "
        f"loads its steps started, and each case's times are on its own clock, its blocks and their "
        f"waits."
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model_dir = default_model_dir()
    result = many_adapters(model_dir, args.repeats, print)
    print(result["setup"] + f" torch threads {result['torch_threads']}.")
    print(markdown_table(result["table"]))


if __name__ == "__main__":
    main()

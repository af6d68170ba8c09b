"""What a slow constraint's compile costs the streams beside it, on the default model: 8
unconstrained greedy streams of 64 tokens decoded alone, then again while a GBNF grammar of
64 KiB compiles (a chain of rules, which the grammar engine reads in time quadratic in its length;
each round's grammar is new to the engine, so each compiles). Per arm: the streams' tokens/s and
the longest wait between two tokens of the first stream; the compile's seconds. And the seconds a
small GBNF grammar (SMALL, new each round) takes to compile while the streams decode. Rounds
alternate which arm goes first; medians are printed.

    .venv/bin/python -m bench.compile_stall [--rounds 3]
"""

import argparse
import itertools
import statistics
import string
import threading
import time
from collections.abc import Callable
from functools import partial

from bench.cache import default_model_dir
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import MAX_STRUCTURED_CHARS, SamplingParams, Structured
from shared import tcmalloc

STREAMS, PROMPT, TOKENS = 8, 16, 64
SMALL = 'root ::= "{" ws "\\"k\\":" ws value ws "}"\nvalue ::= [0-9]+ | "{end}"\nws ::= [ ]?'


def gbnf_chain(end: str) -> str:
    """root ::= aaa, aaa ::= "a" aab, ... as many rules as MAX_STRUCTURED_CHARS holds, the last
    one matching `end`."""
    names = ["".join(t) for t in itertools.product(string.ascii_lowercase, repeat=3)]
    rules, size = [f"root::={names[0]}"], 0
    for i, name in enumerate(names[:-1]):
        rule = f'{name}::="a"{names[i + 1]}'
        size += len(rule) + 1
        if size > MAX_STRUCTURED_CHARS - 64:
            return "\n".join([*rules, f'{name}::="{end}"'])
        rules.append(rule)
    raise AssertionError("more names are needed")


def decode(engine: Engine) -> tuple[float, float]:
    """(tokens/s of the streams, the longest wait between two tokens of the first)."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    requests = [Request([100 + i] * PROMPT, None, params) for i in range(STREAMS)]
    first, arrivals = requests[0].request_id, []
    start = time.perf_counter()
    engine.generate(
        requests, on_delta=lambda d: arrivals.append(time.perf_counter()) if d.request_id == first else None
    )
    seconds = time.perf_counter() - start
    return STREAMS * TOKENS / seconds, max(b - a for a, b in itertools.pairwise(arrivals))


def alongside(background: Callable[[], object], timed: Callable[[], object], settle_s: float):
    """timed()'s result, called once background() has run on another thread for settle_s."""
    thread = threading.Thread(target=background)
    thread.start()
    time.sleep(settle_s)
    result = timed()
    thread.join()
    return result


def seconds_of(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def beside_a_compile(engine: Engine, grammar: str) -> tuple[float, float, float]:
    """decode() while `grammar` compiles on another thread, and the compile's seconds."""
    compiled: list[float] = []
    compile_it = partial(engine.grammars.matcher, Structured("grammar", grammar))
    rate, longest = alongside(lambda: compiled.append(seconds_of(compile_it)), partial(decode, engine), 0.05)
    return rate, longest, compiled[0]


def small_beside_decoding(engine: Engine, grammar: str) -> float:
    """Seconds `grammar` takes to compile while decode() runs on another thread."""
    compile_it = partial(engine.grammars.matcher, Structured("grammar", grammar))
    return alongside(partial(decode, engine), partial(seconds_of, compile_it), 0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tcmalloc.run_again_preloaded()
    config = EngineConfig(
        model=str(default_model_dir()),
        kv_cache_tokens=4096,
        max_model_len=256,
        grammar_compile_timeout_s=120,  # the compile is what is timed, however long it takes
    )
    engine = Engine(config)
    engine.grammars.prepare()
    decode(engine)  # warm-up
    alone, beside, compiles, small = [], [], [], []
    for r in range(args.rounds):
        for arm in ("alone", "beside") if r % 2 == 0 else ("beside", "alone"):
            if arm == "alone":
                alone.append(decode(engine))
            else:
                rate, longest, seconds = beside_a_compile(engine, gbnf_chain(f"end {r}"))
                beside.append((rate, longest))
                compiles.append(seconds)
        small.append(small_beside_decoding(engine, SMALL.replace("{end}", f"end {r}")))
        print(f"round {r}: alone {alone[-1][0]:.0f} tok/s, beside {beside[-1][0]:.0f} tok/s", flush=True)
    for name, runs in (("alone", alone), ("beside the compile", beside)):
        rate = statistics.median(rate for rate, _ in runs)
        longest = statistics.median(longest for _, longest in runs)
        print(f"{name}: {rate:.0f} tok/s, longest wait between tokens {longest * 1e3:.0f} ms (medians)")
    print(f"the compile: {statistics.median(compiles):.1f} s (median)")
    print(f"a small GBNF grammar's compile beside the streams: {statistics.median(small):.2f} s (median)")


if __name__ == "__main__":
    main()

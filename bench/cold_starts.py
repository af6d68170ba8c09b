"""Cold starts, over gRPC through a real store and worker, on the default model. Streams on
resident adapters decode while short probe requests arrive on a fixed schedule; in one run the
probes name cold adapters (fetched from the store, loaded, activated), in the other the same probes
name resident ones. Measured side by side, round by round:
- time to first token of the probes: cold against resident;
- inter-token latency of the resident streams while the probes are in flight: with the cold loads
  against without (no head-of-line blocking: target p50 and p99 within 1.2x).

    .venv/bin/python -m bench.cold_starts [--repeats 3]
"""

import argparse
import itertools
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import loramux
from bench.cache import default_model_dir
from bench.local_stack import local_stack
from bench.random_adapter import write_random_adapter
from shared.model_config import ModelConfig

STREAMS, HOT, PROBES, RANK = 8, 4, 8, 16
# The streams are left once the last probe has its first token; STREAM_TOKENS only caps them (at 21
# ms a token on 2 cores they would last 10 s, where the probes take about 3.5 s)
PROMPT, STREAM_TOKENS = 32, 512
PROBE_START_S, PROBE_GAP_S = 0.5, 0.4  # the first probe leaves once the streams decode
SLOTS = HOT + PROBES // 2  # cold probes must take turns for slots, as in a busy worker


@dataclass(frozen=True)
class Run:
    """One run's probes and what the resident streams saw while the probes were in flight."""

    gaps: list[float]  # seconds between consecutive tokens of the resident streams
    ttft: list[float]  # seconds to the first token of each probe


def token_times(
    client: loramux.Client,
    adapter: str,
    ids: list[int],
    max_tokens: int,
    until: threading.Event | None = None,
) -> list[float]:
    """perf_counter at each token's arrival (the tokens of one delta share its time); the stream is
    left (its call cancelled) at its first delta once `until` is set."""
    times = []
    deltas = client.generate(
        token_ids=ids, adapter=adapter, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=600
    )
    for delta in deltas:
        times += [time.perf_counter()] * len(delta.token_ids)
        if until is not None and until.is_set():
            break
    return times


def probe(client: loramux.Client, adapter: str, ids: list[int]) -> tuple[float, float]:
    """(sent, first token) perf_counter times of a one-token request."""
    sent = time.perf_counter()
    return sent, token_times(client, adapter, ids, 1)[0]


def run(client: loramux.Client, probe_adapters: list[str]) -> Run:
    probed = threading.Event()  # the last probe has its first token
    with ThreadPoolExecutor(STREAMS + PROBES) as pool:
        streams = [
            pool.submit(token_times, client, f"hot-{i % HOT}", [100 + i] * PROMPT, STREAM_TOKENS, probed)
            for i in range(STREAMS)
        ]
        time.sleep(PROBE_START_S)
        probes = []
        for k, adapter in enumerate(probe_adapters):
            probes.append(pool.submit(probe, client, adapter, [50 + k] * PROMPT))
            time.sleep(PROBE_GAP_S)
        times = [p.result() for p in probes]
        probed.set()
        window = (times[0][0], max(first for _, first in times))
        gaps = streams_gaps([s.result() for s in streams], window)
    return Run(gaps, [first - sent for sent, first in times])


def streams_gaps(streams: list[list[float]], window: tuple[float, float]) -> list[float]:
    """Every stream's gaps ending inside `window`, which each stream must outlast: one that ended
    sooner would leave the rest of the window unmeasured."""
    if min(times[-1] for times in streams) < window[1]:
        raise RuntimeError("a stream ended before the last probe's first token: raise STREAM_TOKENS")
    return [g for times in streams for g in gaps_within(times, window)]


def gaps_within(times: list[float], window: tuple[float, float]) -> list[float]:
    """Gaps between consecutive tokens whose later token arrived inside `window`."""
    return [b - a for a, b in itertools.pairwise(times) if window[0] <= b <= window[1]]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def cold_starts(
    model_dir: Path, repeats: int = 3, progress: Callable[[str], None] = lambda line: None
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "adapters"
        model = ModelConfig.from_dir(model_dir)
        rounds = repeats + 1  # round 0 warms up and is dropped
        progress(f"writing {HOT + rounds * PROBES} random rank-{RANK} adapters")
        names = [f"hot-{i}" for i in range(HOT)]
        names += [f"cold-{r}-{k}" for r in range(rounds) for k in range(PROBES)]
        folders = [write_random_adapter(model, root / name, RANK, seed=i) for i, name in enumerate(names)]
        progress("starting a store and a worker")
        flags = ["--max-loras", str(SLOTS), "--max-lora-rank", str(RANK), "--max-cpu-loras", str(SLOTS)]
        longest = PROMPT + STREAM_TOKENS + 16  # + 16: a partly used last block
        flags += ["--kv-cache-tokens", str((STREAMS + PROBES) * longest), "--max-model-len", str(longest)]
        with local_stack(model_dir, root, Path(tmp), *flags) as client:
            for folder in folders:
                client.register_adapter(folder.name, f"file://{folder}")
            return summary(measure(client, rounds, progress), repeats)


def measure(client: loramux.Client, rounds: int, progress: Callable[[str], None]) -> dict[str, list[Run]]:
    """Per round, both runs back to back, alternating which goes first."""
    resident = [f"hot-{k % HOT}" for k in range(PROBES)]
    runs: dict[str, list[Run]] = {"resident": [], "cold": []}
    for r in range(rounds):
        progress(f"round {r}/{rounds - 1}" if r else "warm-up round")
        cold = [f"cold-{r}-{k}" for k in range(PROBES)]
        order = [("resident", resident), ("cold", cold)][:: 1 if r % 2 else -1]
        for case, adapters in order:
            result = run(client, adapters)
            if r:
                runs[case].append(result)
    return runs


def summary(runs: dict[str, list[Run]], repeats: int) -> dict:
    """Per round p50/p99 of each side; medians over rounds, and medians of per-round ratios."""
    stats = {
        case: {
            "ttft p50": [statistics.median(run.ttft) for run in case_runs],
            "itl p50": [statistics.median(run.gaps) for run in case_runs],
            "itl p99": [percentile(run.gaps, 99) for run in case_runs],
        }
        for case, case_runs in runs.items()
    }
    ratios = {
        name: [c / r for c, r in zip(stats["cold"][name], stats["resident"][name], strict=True)]
        for name in stats["cold"]
    }
    rows = [
        ("ttft p50", "TTFT of a probe, cold adapter, p50 ms", "same probe, resident adapter, p50 ms"),
        ("itl p50", "ITL of resident streams while cold adapters load, p50 ms", "with no load, p50 ms"),
        ("itl p99", "ITL of resident streams while cold adapters load, p99 ms", "with no load, p99 ms"),
    ]
    table = [
        {
            "case": case,
            "value": round(statistics.median(stats["cold"][name]) * 1e3, 1),
            "baseline": baseline,
            "baseline value": round(statistics.median(stats["resident"][name]) * 1e3, 1),
            "ratio": round(statistics.median(ratios[name]), 2),
        }
        for name, case, baseline in rows
    ]
    return {
        "setup": (
            f"default model; a store and a worker process on this machine (max_loras {SLOTS}, "
            f"max_cpu_loras {SLOTS}); {STREAMS} greedy streams ({PROMPT}-token prompts, left once the "
            f"last probe has its first token) on {HOT} resident rank-{RANK} all-linear adapters; "
            f"{PROBES} one-token probes ({PROMPT}-token prompts) sent every {PROBE_GAP_S} s from "
            f"{PROBE_START_S} s on, naming {PROBES} never-fetched adapters (cold: fetch from the store, "
            f"digest check, load, activate) or resident ones; ITL counts the resident streams' token "
            f"gaps from the first probe sent to the last probe's first token; p50/p99 per run, medians "
            f"of {repeats} rounds (both runs back to back, alternating order) after a warm-up round"
        ),
        "table": table,
        "values": {case: {name: values for name, values in s.items()} for case, s in stats.items()},
        "ratios": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = default_model_dir()
    result = cold_starts(model_dir, args.repeats, print)
    print(result["setup"])
    for row in result["table"]:
        print(f"{row['case']}: {row['value']} against {row['baseline']} {row['baseline value']}")
        print(f"    ratio {row['ratio']}")


if __name__ == "__main__":
    main()

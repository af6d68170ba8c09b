"""A hostile prompt beside a normal stream, over gRPC to a real worker on the default model. While
one greedy stream decodes, another caller (a process of its own) sends huge text prompts: 15 MB
(over the 4 MiB message limit: gRPC drops it before Python parses it), 3 MB (under the message
limit, over the prompt byte bound: refused untokenized) and one just under the bound (tokenized in
a thread, then refused for its length). Measured per prompt: the time to refuse it, a GetStats
sent beside it, and the stream's largest gap between tokens while it was in flight, against the
stream's median gap (target: refusal under 0.1 s, gap under 2x the median).

    .venv/bin/python -m bench.hostile_prompt [--repeats 3]
"""

import argparse
import itertools
import multiprocessing
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.cache import default_model_dir
from bench.local_stack import start, wait_ready
from inference_service.engine.tokenizer import Tokenizer
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as pb_grpc

HUGE_BYTES, LARGE_BYTES = 15_000_000, 3_000_000
MAX_MODEL_LEN = 4096  # the worker's default
STREAM_TOKENS, START_AFTER_TOKENS, GAP_S = 150, 10, 0.5
# Room for the 15 MB prompt; a channel's own connection, never one shared with another caller.
CHANNEL = [("grpc.max_send_message_length", 32 << 20), ("grpc.use_local_subchannel_pool", 1)]


def stream_times(address: str, started: threading.Event) -> list[float]:
    """perf_counter at each token's arrival of one greedy stream."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[100] * 32),
        sampling=pb.SamplingParams(max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True),
    )
    times: list[float] = []
    with grpc.insecure_channel(address, CHANNEL) as channel:
        for response in pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=600):
            times += [time.perf_counter()] * len(response.delta.token_ids)
            if len(times) >= START_AFTER_TOKENS:
                started.set()
    return times


def send_hostile(address: str, text_bytes: int, text: str) -> tuple[float, float, str]:
    """In the hostile caller's process: (sent, answered) perf_counter times of one prompt of
    "hello world " repeated to `text_bytes` (or `text_bytes` of "x" when `text` is "x"), and the status."""
    body = "x" * text_bytes if text == "x" else text * (text_bytes // len(text))
    payload = pb.GenerateRequest(text=body).SerializeToString()  # built before the clock starts
    with grpc.insecure_channel(address, CHANNEL) as channel:
        call = channel.unary_stream("/loramux.inference.v1.InferenceService/Generate")
        sent = time.perf_counter()
        try:
            list(call(payload, timeout=600))
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        return sent, time.perf_counter(), code


def stats_calls(address: str, until: threading.Event) -> list[tuple[float, float]]:
    """(sent, seconds) of GetStats calls made back to back, 20 ms apart, until `until` is set."""
    calls = []
    with grpc.insecure_channel(address, CHANNEL) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        while not until.is_set():
            sent = time.perf_counter()
            stub.GetStats(pb.GetStatsRequest(), timeout=600)
            calls.append((sent, time.perf_counter() - sent))
            time.sleep(0.02)
    return calls


def one_round(address: str, hostile: ProcessPoolExecutor, prompts: dict[str, tuple[int, str]]) -> dict:
    started, done = threading.Event(), threading.Event()
    with ThreadPoolExecutor(2) as threads:
        stream = threads.submit(stream_times, address, started)
        stats = threads.submit(stats_calls, address, done)
        started.wait(120)
        windows = {}
        for name, (size, text) in prompts.items():
            time.sleep(GAP_S)
            windows[name] = hostile.submit(send_hostile, address, size, text).result()
        last = time.perf_counter()
        times = stream.result()
        done.set()
        calls = stats.result()
    if times[-1] < last + GAP_S:
        raise RuntimeError("the stream ended before the prompts were refused: raise STREAM_TOKENS")
    gaps = [(a, b - a) for a, b in itertools.pairwise(times)]
    median = statistics.median(g for _, g in gaps)

    def during(spans: list[tuple[float, float]], start: float, end: float) -> float:
        """The longest span overlapping [start, end]."""
        return max(length for at, length in spans if at <= end and at + length >= start)

    return {
        name: {
            "refusal_s": answered - sent,
            "code": code,
            "get_stats_s": during(calls, sent, answered),
            "median_get_stats_s": statistics.median(length for _, length in calls),
            "max_gap_s": during(gaps, sent, answered),
            "median_gap_s": median,
        }
        for name, (sent, answered, code) in windows.items()
    }


def hostile_prompt(model_dir: Path, repeats: int) -> list[dict]:
    """Rounds of the measurement after one warm-up round."""
    bound = MAX_MODEL_LEN * Tokenizer.from_dir(model_dir).max_token_bytes
    prompts = {
        "15 MB": (HUGE_BYTES, "x"),
        "3 MB": (LARGE_BYTES, "x"),
        f"{bound // 1000} KB, under the bound": (bound, "hello world "),
    }
    worker, address = start("inference_service", "--model", str(model_dir))
    try:
        wait_ready(address)
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=spawn) as hostile:
            hostile.submit(time.sleep, 0).result()  # the process is up before any clock starts
            return [one_round(address, hostile, prompts) for _ in range(repeats + 1)][1:]
    finally:
        worker.terminate()
        worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rounds = hostile_prompt(default_model_dir(), args.repeats)
    print(
        f"default model; one greedy stream of {STREAM_TOKENS} tokens; {args.repeats} rounds after a warm-up"
    )
    for r, result in enumerate(rounds):
        for name, m in result.items():
            print(
                f"  round {r}, {name} prompt: refused ({m['code']}) in {m['refusal_s'] * 1e3:.0f} ms; "
                f"GetStats beside it {m['get_stats_s'] * 1e3:.0f} ms (median "
                f"{m['median_get_stats_s'] * 1e3:.0f} ms); the stream's largest gap meanwhile "
                f"{m['max_gap_s'] * 1e3:.0f} ms against its median {m['median_gap_s'] * 1e3:.0f} ms "
                f"({m['max_gap_s'] / m['median_gap_s']:.2f}x)"
            )


if __name__ == "__main__":
    main()

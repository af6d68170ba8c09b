"""A CPU worker's time to ready on the default model: from its process's start until its readiness
check says SERVING (its weights loaded and packed, its adapter memory and KV cache allocated, all
on 2 MiB pages). Two arms, alternating round by round, both on tcmalloc as `make run` starts them:
the worker as it starts by default (torch's allocator advised to ask for 2 MiB pages from the first
write: shared/huge_page_advice.py), and with the advice turned off (THP_MEM_ALLOC_ENABLE=0), where
the memory is copied onto 2 MiB pages once loaded (inference_service/engine/huge_pages.py).

    .venv/bin/python -m bench.worker_start [--rounds 5]
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.cache import default_model_dir
from bench.local_stack import service, wait_ready
from shared.huge_page_advice import ENV, heeded

ARMS = {"advised": None, "not advised": "0"}  # THP_MEM_ALLOC_ENABLE in the worker's environment


def seconds_to_ready(model_dir: Path, cache: Path, advice: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["LORAMUX_CACHE"] = str(cache)
    if advice is not None:
        env[ENV] = advice
    began = time.perf_counter()
    with service("inference_service", "--model", str(model_dir), env=env) as address:
        wait_ready(address)
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not heeded():
        raise SystemExit("this kernel's transparent huge pages are off: both arms would be the same")
    model_dir = default_model_dir()
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for arm in list(ARMS)[:: 1 if round_ % 2 == 0 else -1]:
                times[arm].append(seconds_to_ready(model_dir, Path(tmp) / "cache", ARMS[arm]))
    for arm, seconds in times.items():
        spread = ", ".join(f"{s:.2f}" for s in seconds)
        print(f"{arm:12s} median {statistics.median(seconds):.2f} s to ready (rounds: {spread})")


if __name__ == "__main__":
    main()

"""A benchmark's result record, bench/results/<name>.json: its figures, the commands that measured
it and rerun it alone, and where the figures came from (bench/provenance.py: commit, machine, time),
so that REPORT.md can name them beside every figure."""

import json
import time
from collections.abc import Callable
from pathlib import Path

from bench.provenance import provenance
from bench.report import write_atomic


def measure(name: str, title: str, run: Callable[[], dict], command: str, rerun: str) -> dict:
    """Runs `run` (a benchmark's rounds, returning its result) and returns its record."""
    start = time.perf_counter()
    origin = provenance()  # the code as it was when the run began
    result = run()
    return {
        "benchmark": name,
        "title": title,
        "command": command,
        "rerun": rerun,
        **origin,
        "wall_s": round(time.perf_counter() - start, 1),
        "result": result,
    }


def write_record(results_dir: Path, record: dict) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)  # a --results folder not made yet: not a lost run
    path = results_dir / f"{record['benchmark']}.json"
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return path

"""Where a benchmark's figures came from, recorded with every result: the code (git commit), the
machine (CPU model, its family and model numbers, the instruction sets torch's CPU kernels choose
between, cores, torch and its threads, Python, the allocator) and the time. Figures from two runs
compare only when these agree."""

import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import torch

from shared import tcmalloc

REPO = Path(__file__).resolve().parents[1]
RESULTS = "bench/results"  # what a suite writes as it goes: a change there is no change of code
# x86 extensions that pick torch's CPU kernels (oneDNN, FBGEMM): bf16 matmuls run several times
# faster with AMX than with AVX2 alone, and a CPU model name ("AMD EPYC") may not say which.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def provenance() -> dict:
    """The "commit", "machine" and "utc" fields of a result record, taken now."""
    return {
        "commit": commit(),
        "machine": machine(),
        "utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def commit(repo: Path = REPO) -> str:
    """HEAD's short hash, "+dirty" when tracked files other than bench results differ from it
    (the figures then came from code no commit holds); "unknown" outside a git checkout."""
    try:
        head = _git(repo, "rev-parse", "--short", "HEAD")
        changed = _git(repo, "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{RESULTS}")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def machine() -> dict:
    cpu = cpuinfo()
    flags = set(cpu.get("flags", "").split())
    return {
        "platform": platform.platform(),
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        # a generation the name may not tell ("AMD EPYC": family 25 is Zen 3 and 4, 26 Zen 5)
        "cpu_family": f"family {cpu['cpu family']} model {cpu['model']}" if "cpu family" in cpu else None,
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "malloc": "tcmalloc" if tcmalloc.loaded() else "glibc",  # python -m bench.allocator: how far apart
    }


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...); none off Linux."""
    path = Path("/proc/cpuinfo")
    first = path.read_text().split("\n\n")[0] if path.is_file() else ""
    fields = (line.split(":", 1) for line in first.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in fields}

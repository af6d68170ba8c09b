"""tcmalloc under the CPU's workers, as vLLM's and SGLang's CPU backends ask for it. torch's CPU ops
allocate and free their outputs many times a step; glibc's malloc consolidates its free lists as
they come back, tcmalloc's thread caches do not. Since decode runs on prepacked kernels into
buffers kept from step to step, that is worth a few percent at most there: tcmalloc / glibc on the
default model's decode, medians of 6 pairs of processes, 1.006 to 1.06 over batches 1, 8 and 32 in
fp32 and bf16 (2 cores, 2026-11-30: `python -m bench.allocator`). A worker's start gains more
(README, `bench.worker_start`).

It cannot be switched on from inside a process: the dynamic loader must load it first, from
LD_PRELOAD. So launchers preload it where it is installed (Debian's libtcmalloc-minimal4: the image,
`make run`, `make test` and `make bench` install it), the benchmarks' entry points run themselves
again on it, so their figures come from the allocator the workers use, and a CPU worker started
without it says so.
"""

import ctypes.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

ADVICE = (
    "decode runs up to a few percent faster on tcmalloc and a worker starts sooner: install "
    "Debian's libtcmalloc-minimal4 and start with LD_PRELOAD=libtcmalloc_minimal.so.4"
)


def library() -> str | None:
    """tcmalloc's soname where it is installed, which LD_PRELOAD takes as it is."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def preloading(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with tcmalloc first in LD_PRELOAD, where it is installed and not there yet."""
    env, found = dict(env), library()
    preloaded = env.get("LD_PRELOAD", "")
    if found and "tcmalloc" not in preloaded:
        env["LD_PRELOAD"] = ":".join(filter(None, [found, preloaded]))
    return env


def run_again_preloaded() -> None:
    """Replaces this process with its own command line on tcmalloc, where it is installed and
    LD_PRELOAD does not name it yet; else returns. Once only: a tcmalloc in LD_PRELOAD that the
    loader could not load is not tried again."""
    env = preloading(os.environ)
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether this process allocates with tcmalloc (a library of it is mapped)."""
    try:
        return "libtcmalloc" in maps.read_text()
    except OSError:  # no procfs: say nothing is missing rather than guess
        return True

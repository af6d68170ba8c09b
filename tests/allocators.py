"""A line of Python run in a fresh process on glibc's malloc, then in one with tcmalloc preloaded."""

import os
import subprocess
import sys

from shared import tcmalloc


def on_each_allocator(probe: str) -> tuple[str, str]:
    """What `probe` printed without tcmalloc, and with it preloaded."""
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    printed = []
    for environment in (env, tcmalloc.preloading(env)):
        reply = subprocess.run([sys.executable, "-c", probe], env=environment, capture_output=True, text=True)
        assert reply.returncode == 0, reply.stderr
        printed.append(reply.stdout.strip())
    return printed[0], printed[1]

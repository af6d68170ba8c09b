"""A short Python script run in a child process of this interpreter: for work that must not hold
this process's GIL or one of its threads (a pure-Python reader, a backtracking regex), isolated
(-I), fed on stdin, bounded in time."""

import subprocess
import sys


class ScriptFailed(Exception):
    """The script exited non-zero; the message is the last line it wrote to stderr (what it gave
    sys.exit)."""


def run_script(script: str, given: str, timeout_s: float) -> str:
    """What `script` writes to stdout, fed `given`. subprocess.TimeoutExpired past timeout_s (the
    child is killed), ScriptFailed when it fails."""
    child = subprocess.run(
        [sys.executable, "-I", "-c", script], input=given, capture_output=True, text=True, timeout=timeout_s
    )
    if child.returncode != 0:
        lines = child.stderr.strip().splitlines()
        raise ScriptFailed(lines[-1] if lines else f"the script exited {child.returncode}")
    return child.stdout

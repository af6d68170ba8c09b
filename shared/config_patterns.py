"""The regexes an adapter_config.json carries (target_modules given as one regex, rank_pattern's
and alpha_pattern's keys), matched whole against module names in a child process, within a time
bound. Python's re backtracks: `(.|.)*x` against one 31-character module name ran for more than
a minute, holding the thread that registered the adapter, and nothing can stop re in a thread."""

import json
import subprocess
import sys

from shared.errors import InvalidArgument

# The patterns PEFT writes match a model's thousands of module names in milliseconds; the child
# itself starts in about 20 ms.
MATCH_SECONDS = 2.0
MATCH = """
import json, re, sys
given = json.load(sys.stdin)
matches = {}
for pattern in given["patterns"]:
    try:
        whole = re.compile(pattern)
    except re.error as e:
        sys.exit(f"{pattern!r} is not a regex ({e})")
    matches[pattern] = [name for name in given["names"] if whole.fullmatch(name)]
json.dump(matches, sys.stdout)
"""


def fullmatches(patterns: set[str], names: list[str], where: str) -> dict[str, frozenset[str]]:
    """pattern -> the names it matches whole. InvalidArgument naming a pattern that is no regex, or
    saying how long the matching ran when it runs past MATCH_SECONDS."""
    if not patterns:
        return {}
    given = json.dumps({"patterns": sorted(patterns), "names": names})
    try:
        child = subprocess.run(
            [sys.executable, "-I", "-c", MATCH],
            input=given,
            capture_output=True,
            text=True,
            timeout=MATCH_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise InvalidArgument(
            f"{where}: its {len(patterns)} regexes (target_modules, rank_pattern and alpha_pattern) took "
            f"longer than {MATCH_SECONDS:g} s to match the model's {len(names)} module names"
        ) from None
    if child.returncode != 0:
        lines = child.stderr.strip().splitlines()
        raise InvalidArgument(
            f"{where}: {lines[-1] if lines else f'regex matching exited {child.returncode}'}"
        )
    return {pattern: frozenset(matched) for pattern, matched in json.loads(child.stdout).items()}

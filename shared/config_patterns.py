"""The regexes an adapter_config.json carries (target_modules given as one regex, rank_pattern's
and alpha_pattern's keys), matched whole against module names in a child process, within a time
bound. Python's re backtracks: `(.|.)*x` against one 31-character module name ran for more than
a minute, holding the thread that registered the adapter, and nothing can stop re in a thread."""

import json
import subprocess

from shared.child_script import ScriptFailed, run_script
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
        matches = json.loads(run_script(MATCH, given, MATCH_SECONDS))
    except subprocess.TimeoutExpired:
        raise InvalidArgument(
            f"{where}: its {len(patterns)} regexes (target_modules, rank_pattern and alpha_pattern) took "
            f"longer than {MATCH_SECONDS:g} s to match the model's {len(names)} module names"
        ) from None
    except ScriptFailed as e:
        raise InvalidArgument(f"{where}: {e}") from None
    return {pattern: frozenset(matched) for pattern, matched in matches.items()}

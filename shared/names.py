"""Adapter ids: the one naming rule both services enforce."""

import re

from shared.errors import InvalidArgument

# Used with fullmatch only: match with "$" would also take a name followed by "\n".
ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_adapter_id(name: str) -> str:
    if not isinstance(name, str) or not ADAPTER_ID.fullmatch(name):
        raise InvalidArgument(
            f"adapter id {name!r} is invalid: 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name

"""The worker's command line: the message-size flag and its bounds."""

import pytest

from inference_service.__main__ import parse_config
from shared.errors import InvalidArgument


def test_max_message_bytes_defaults_to_16_mib_and_is_bounded():
    assert parse_config(["--model", "m"]).max_message_bytes == 4 << 20
    assert parse_config(["--model", "m", "--max-message-bytes", "4096"]).max_message_bytes == 4096
    for bad in ("10", str(1 << 31)):
        with pytest.raises(InvalidArgument, match=rf"max_message_bytes must be in .*, got {bad}$"):
            parse_config(["--model", "m", "--max-message-bytes", bad])

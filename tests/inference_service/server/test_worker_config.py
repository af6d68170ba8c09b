"""The worker's command line: the message-size and step-timeout flags and their bounds."""

import pytest

from inference_service.server.main import parse_config
from shared.errors import InvalidArgument


def test_max_message_bytes_defaults_to_4_mib_and_is_bounded():
    assert parse_config(["--model", "m"]).max_message_bytes == 4 << 20
    assert parse_config(["--model", "m", "--max-message-bytes", "4096"]).max_message_bytes == 4096
    for bad in ("10", str(1 << 31)):
        with pytest.raises(InvalidArgument, match=rf"max_message_bytes must be in .*, got {bad}$"):
            parse_config(["--model", "m", "--max-message-bytes", bad])


def test_step_timeout_defaults_to_a_minute_and_must_be_positive():
    assert parse_config(["--model", "m"]).engine.step_timeout_s == 60.0
    assert parse_config(["--model", "m", "--step-timeout", "2.5"]).engine.step_timeout_s == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(InvalidArgument, match="step_timeout_s must be a positive number"):
            parse_config(["--model", "m", "--step-timeout", bad])


def test_decode_steps_use_cuda_graphs_unless_eager():
    assert parse_config(["--model", "m"]).engine.cuda_graphs is True
    assert parse_config(["--model", "m", "--eager"]).engine.cuda_graphs is False


def test_metrics_are_off_unless_given_a_host_and_port():
    assert parse_config(["--model", "m"]).metrics_listen is None
    assert parse_config(["--model", "m", "--metrics-listen", "[::]:9400"]).metrics_listen == "[::]:9400"
    with pytest.raises(InvalidArgument, match="metrics address ':9400' is not HOST:PORT"):
        parse_config(["--model", "m", "--metrics-listen", ":9400"])


def test_tensor_parallelism_is_off_unless_asked_and_its_size_must_be_positive():
    engine = parse_config(["--model", "m"]).engine
    assert (engine.tensor_parallel_size, engine.fully_sharded_loras) == (1, False)
    engine = parse_config(["--model", "m", "--tensor-parallel-size", "3", "--fully-sharded-loras"]).engine
    assert (engine.tensor_parallel_size, engine.fully_sharded_loras) == (3, True)
    with pytest.raises(InvalidArgument, match="tensor_parallel_size must be at least 1, got 0"):
        parse_config(["--model", "m", "--tensor-parallel-size", "0"])
    with pytest.raises(InvalidArgument, match="tensor-parallel ranks run on cuda:0, cuda:1"):
        parse_config(["--model", "m", "--tensor-parallel-size", "2", "--device", "cuda:1"])

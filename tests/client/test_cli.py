"""The `loramux` command against the real store and the real default-model worker: what it prints,
how it exits."""

import os
import subprocess
import sys

import pytest

import loramux
from loramux import cli
from tests.adapter_store.conftest import ADMIN_TOKEN, REPO
from tests.client.conftest import API_TOKEN, DEFAULT_ADAPTER


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m loramux ARGS` with LORAMUX_* taken from `env` only."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    command = [sys.executable, "-m", "loramux", *args]
    return subprocess.run(command, cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=60)


def test_register_list_and_get_through_the_environment(store, sources_root):
    env = {"LORAMUX_STORE": store.address, "LORAMUX_ADMIN_TOKEN": ADMIN_TOKEN}
    registered = run_cli("adapters", "register", "cli-a", f"file://{sources_root / 'qv4'}", **env)
    assert registered.returncode == 0, registered.stderr
    assert "adapter_id: cli-a" in registered.stdout.splitlines() and "rank: 4" in registered.stdout

    listed = run_cli("adapters", "list", **env)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "DIGEST", "RANK", "SIZE", "PINNED", "SOURCE"]
    row = next(r.split() for r in rows if r.startswith("cli-a "))
    assert len(row[1]) == 12 and row[2] == "4" and row[-2:] == ["no", f"file://{sources_root / 'qv4'}"]

    missing = run_cli("adapters", "get", "no-such-adapter", **env)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith("loramux: NOT_FOUND: ") and "no-such-adapter" in missing.stderr


def test_generate_with_an_adapter_streams_its_text_to_stdout(default_worker):
    address, prompt = default_worker.address, "The capital of France is"
    result = run_cli(
        *("--worker", address, "--api-token", API_TOKEN, "generate", "--adapter", DEFAULT_ADAPTER),
        *("--max-tokens", "8", "--temperature", "0", prompt),
    )
    assert result.returncode == 0, result.stderr
    with loramux.Client(worker=address, api_token=API_TOKEN, timeout=60) as client:
        expected = client.complete(prompt, adapter=DEFAULT_ADAPTER, max_tokens=8, temperature=0)
    assert result.stdout == expected.text + "\n" and "Paris" in result.stdout
    assert "finish: length" in result.stderr and "8 generated" in result.stderr


def test_pin_unpin_delete_and_errors(store, sources_root, capsys):
    flags = ["--store", store.address, "--admin-token", ADMIN_TOKEN]
    assert cli.run([*flags, "adapters", "register", "cli-pin", f"file://{sources_root / 'all8'}"], {}) == 0
    assert cli.run([*flags, "adapters", "pin", "cli-pin"], {}) == 0
    assert cli.run([*flags, "adapters", "delete", "cli-pin"], {}) == 1
    assert "loramux: FAILED_PRECONDITION: " in capsys.readouterr().err
    assert cli.run([*flags, "adapters", "delete", "cli-pin", "--force"], {}) == 0
    assert capsys.readouterr().out.startswith("deleted cli-pin (sha256:")

    assert cli.run(["--store", store.address, "adapters", "list"], {}) == 1
    assert "loramux: UNAUTHENTICATED: " in capsys.readouterr().err
    assert cli.run(["--store", store.address, "adapters", "list"], {"LORAMUX_ADMIN_TOKEN": ADMIN_TOKEN}) == 0
    with pytest.raises(SystemExit) as usage:
        cli.run([*flags, "adapters", "frobnicate"], {})
    assert usage.value.code == 2


def test_chat_generate_model_info_and_worker_adapters(default_worker, capsys):
    flags = ["--worker", default_worker.address, "--api-token", API_TOKEN]
    question = "What is the capital of France?"
    generate = ["generate", "--chat", "--adapter", DEFAULT_ADAPTER, "--max-tokens", "24"]
    assert cli.run([*flags, *generate, "--temperature", "0", question], {}) == 0
    assert "Paris" in capsys.readouterr().out

    assert cli.run([*flags, "model-info"], {}) == 0
    fields = capsys.readouterr().out.splitlines()
    assert "model_name: SmolLM2-135M-Instruct" in fields and "has_chat_template: True" in fields
    assert "tool_call_format: " in fields  # SmolLM2's template teaches no tool calls
    assert cli.run([*flags, "worker-adapters"], {}) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["ID", "LOCATION", "PINNED", "DIGEST"]
    assert [row.split()[:3] for row in rows] == [[DEFAULT_ADAPTER, "device", "no"]]
    assert len(rows[0].split()[3]) == 12

    assert cli.run(["--worker", default_worker.address, "generate", "hi"], {}) == 1
    assert "loramux: UNAUTHENTICATED: " in capsys.readouterr().err

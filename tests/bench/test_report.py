import json

from bench.report import markdown_table, write_report


def record(name: str) -> dict:
    return {
        "benchmark": name,
        "title": "LoRA overhead",
        "command": ".venv/bin/python -m bench.suite",
        "rerun": f".venv/bin/python -m bench.suite --only {name}",
        "machine": {
            "platform": "Linux",
            "cpu": "some CPU",
            "cpu_count": 2,
            "usable_cpus": 2,
            "torch": "2.13.0",
            "torch_threads": 2,
            "python": "3.11",
        },
        "utc": "2026-01-01T00:00:00+00:00",
        "wall_s": 12.0,
        "result": {
            "setup": "32 requests",
            "table": [{"adapters": 0, "ratio": 1.0}, {"adapters": 8, "ratio": 0.9}],
        },
    }


def test_markdown_table_has_a_column_per_key_and_a_line_per_row():
    table = markdown_table([{"case": "a|b", "ms": 1.5}, {"case": "c", "ms": 2, "note": "x"}])
    assert table.splitlines() == [
        "| case | ms | note |",
        "|---|---:|---|",
        "| a\\|b | 1.5 |  |",
        "| c | 2 | x |",
    ]


def test_report_has_a_section_per_record_with_table_plot_and_command(tmp_path):
    (tmp_path / "lora_overhead.json").write_text(json.dumps(record("lora_overhead")))
    (tmp_path / "lora_overhead.png").write_bytes(b"png")
    report = write_report(tmp_path, ["lora_overhead", "grpc_overhead"]).read_text()
    assert "## LoRA overhead (`lora_overhead`)" in report
    assert "| 8 | 0.9 |" in report
    assert "![LoRA overhead](lora_overhead.png)" in report
    assert "`.venv/bin/python -m bench.suite --only lora_overhead`" in report
    assert "grpc_overhead" not in report  # no record, no section


def test_a_record_from_before_provenance_says_its_commit_and_cpu_flags_are_not_recorded(tmp_path):
    (tmp_path / "lora_overhead.json").write_text(json.dumps(record("lora_overhead")))
    report = write_report(tmp_path, ["lora_overhead"]).read_text()
    assert (
        "| `lora_overhead` | not recorded | 2026-01-01T00:00:00+00:00 | some CPU (flags not recorded) |"
        in report
    )
    assert "Commit: not recorded (run before provenance was kept)" in report

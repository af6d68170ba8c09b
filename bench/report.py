"""REPORT.md from the suite's result records: one section per benchmark with its setup, its table,
its plot where there is one, the machine and the exact command that measured it."""

import json
from pathlib import Path

HEADER = """# loramux benchmarks

Written by `make bench` (`python -m bench.suite`) from the records beside this file
(`<benchmark>.json`, which also hold every round's raw numbers). Each figure is a ratio or a
distribution whose two sides were measured in the same run, on the default model
(SmolLM2-135M-Instruct, float32); a section's command reruns it alone.
"""


def markdown_table(rows: list[dict]) -> str:
    """A GitHub markdown table: one column per key (in first-seen order), one line per row;
    numeric columns are right-aligned."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    numeric = {c: all(isinstance(row.get(c), int | float) for row in rows) for c in columns}
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if numeric[c] else "---" for c in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def machine_line(machine: dict) -> str:
    return (
        f"{machine['platform']}, {machine['cpu']}, {machine['usable_cpus']} of {machine['cpu_count']} CPUs, "
        f"torch {machine['torch']} with {machine['torch_threads']} threads, Python {machine['python']}"
    )


def section(record: dict, plot: str | None) -> str:
    """The markdown of one benchmark record; `plot` is the PNG's path relative to the report."""
    result = record["result"]
    title = f"## {record['title']} (`{record['benchmark']}`)"
    parts = [title, result["setup"], markdown_table(result["table"])]
    if plot:
        parts.append(f"![{record['title']}]({plot})")
    parts.append(
        f"Measured {record['utc']} in {record['wall_s']:.0f} s on {machine_line(record['machine'])}.  \n"
        f"Command: `{record['command']}`  \n"
        f"This benchmark alone: `{record['rerun']}`"
    )
    return "\n\n".join(parts)


def write_report(results_dir: Path, names: list[str]) -> Path:
    """REPORT.md over the records in `results_dir` of the benchmarks `names`, in that order;
    a benchmark without a record is left out."""
    sections = []
    for name in names:
        path = results_dir / f"{name}.json"
        if path.is_file():
            plot = f"{name}.png" if (results_dir / f"{name}.png").is_file() else None
            sections.append(section(json.loads(path.read_text()), plot))
    report = results_dir / "REPORT.md"
    write_atomic(report, "\n\n".join([HEADER.rstrip(), *sections]) + "\n")
    return report


def write_atomic(path: Path, text: str) -> None:
    """Readers never see half a file: write beside it, then rename over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)

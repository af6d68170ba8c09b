"""REPORT.md from the suite's result records: a table of where each benchmark's figures came from,
then one section per benchmark with its setup, its table, its plot where there is one, the commit
and machine that measured it (bench/provenance.py) and the exact command."""

import json
from pathlib import Path

HEADER = """# loramux benchmarks

Written by `make bench` (`python -m bench.suite`) from the records beside this file
(`<benchmark>.json`, which also hold every round's raw numbers). Each figure is a ratio or a
distribution whose two sides were measured in the same run, on the default model
(SmolLM2-135M-Instruct, float32); a section's command reruns it alone. Sections measured in
different runs may differ in code and machine: each names its own.
"""
NOT_RECORDED = "not recorded"
BEFORE_PROVENANCE = "run before provenance was kept"


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
        f"{machine['platform']}, {cpu(machine)}, {machine['usable_cpus']} of {machine['cpu_count']} CPUs, "
        f"torch {machine['torch']} with {machine['torch_threads']} threads, Python {machine['python']}"
    )


def cpu(machine: dict) -> str:
    """The CPU model (and its family and model numbers where recorded), the flags it has, those it
    lacks: "<model>, family 26 model 2 (avx2, avx512f, no amx_tile)"."""
    name = ", ".join(filter(None, (machine["cpu"], machine.get("cpu_family"))))
    flags = machine.get("cpu_flags")
    if flags is None:
        return f"{name} (flags {NOT_RECORDED})"
    listed = [flag for flag, present in flags.items() if present]
    listed += [f"no {flag}" for flag, present in flags.items() if not present]
    return f"{name} ({', '.join(listed)})"


def commit(record: dict) -> str:
    return f"`{record['commit']}`" if "commit" in record else NOT_RECORDED


def provenance_table(records: list[dict]) -> str:
    """One line per benchmark: the code, CPU and time its figures came from."""
    rows = [
        {
            "benchmark": f"`{r['benchmark']}`",
            "commit": commit(r),
            "measured": r["utc"],
            "CPU": cpu(r["machine"]),
            "malloc": r["machine"].get("malloc", NOT_RECORDED),
        }
        for r in records
    ]
    parts = ["## Where the figures came from", markdown_table(rows)]
    if any("commit" not in r for r in records):
        parts.append(f'"{NOT_RECORDED}": {BEFORE_PROVENANCE}.')
    return "\n\n".join(parts)


def section(record: dict, plot: str | None) -> str:
    """The markdown of one benchmark record; `plot` is the PNG's path relative to the report."""
    result = record["result"]
    title = f"## {record['title']} (`{record['benchmark']}`)"
    parts = [title, result["setup"], markdown_table(result["table"])]
    if plot:
        parts.append(f"![{record['title']}]({plot})")
    code = commit(record) if "commit" in record else f"{NOT_RECORDED} ({BEFORE_PROVENANCE})"
    parts.append(
        f"Measured {record['utc']} in {record['wall_s']:.0f} s.  \n"
        f"Commit: {code}  \n"
        f"Machine: {machine_line(record['machine'])}  \n"
        f"Command: `{record['command']}`  \n"
        f"This benchmark alone: `{record['rerun']}`"
    )
    return "\n\n".join(parts)


def write_report(results_dir: Path, names: list[str]) -> Path:
    """REPORT.md over the records in `results_dir` of the benchmarks `names`, in that order;
    a benchmark without a record is left out."""
    paths = [results_dir / f"{name}.json" for name in names]
    records = [json.loads(path.read_text()) for path in paths if path.is_file()]
    sections = [section(r, _plot_path(results_dir, r["benchmark"])) for r in records]
    parts = [HEADER.rstrip(), provenance_table(records), *sections] if records else [HEADER.rstrip()]
    report = results_dir / "REPORT.md"
    write_atomic(report, "\n\n".join(parts) + "\n")
    return report


def _plot_path(results_dir: Path, name: str) -> str | None:
    return f"{name}.png" if (results_dir / f"{name}.png").is_file() else None


def write_atomic(path: Path, text: str) -> None:
    """Readers never see half a file: write beside it, then rename over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)

"""README quotes only recorded benchmark figures: a sentence that names a benchmark with a record in
bench/results (`bench.moe`, or the record's own name as REPORT.md writes it, `lora_overhead`) may
quote, as figures (numbers with a decimal point: 0.818, 2.16x, 191.5), only values of those
records' tables, rounded as README writes them. A figure from another run, or a target, belongs
in a sentence that names no record."""

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
# bench modules whose record bench.suite names otherwise
RECORD_OF_MODULE = {"http_serving": "http_overhead", "grpc_serving": "grpc_overhead"}
FIGURE = re.compile(r"(?<![\w.-])(\d+\.\d+)x?(?![\w.])")  # not in 3.0-1B, 0.50.2, 2.5e-7 or 0.05²
NUMBER = re.compile(r"\d+(?:\.\d+)?")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def records() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}


def recorded_values(record: dict) -> list[Decimal]:
    """Every number in the record's table: its numeric cells and the numbers in its text cells
    ("0.813 .. 0.829", "0.922x", "+101.9 ms")."""
    values = []
    for row in record["result"]["table"]:
        for cell in row.values():
            if isinstance(cell, int | float) and not isinstance(cell, bool):
                values.append(Decimal(str(cell)))
            elif isinstance(cell, str):
                values += [Decimal(n) for n in NUMBER.findall(cell)]
    return values


def sentences(markdown: str) -> list[str]:
    """README's sentences, each on one line: paragraphs and list items split at their full stops."""
    blocks = re.split(r"\n\s*\n|\n(?=\s*- )", markdown)
    return [s for block in blocks for s in SENTENCE_END.split(" ".join(block.split()))]


def cited(sentence: str, names: set[str]) -> set[str]:
    modules = {RECORD_OF_MODULE.get(m, m) for m in re.findall(r"`bench\.(\w+)", sentence)}
    return (modules | set(re.findall(r"`(\w+)`", sentence))) & names


def is_recorded(figure: str, values: list[Decimal]) -> bool:
    quoted = Decimal(figure)
    return any(v.quantize(quoted, ROUND_HALF_UP) == quoted for v in values)


def unrecorded_figures(markdown: str, by_name: dict[str, dict]) -> list[str]:
    """'<figure> in: <sentence>' for each figure of a record-naming sentence no named record holds."""
    wrong = []
    for sentence in sentences(markdown):
        values = [v for name in cited(sentence, set(by_name)) for v in recorded_values(by_name[name])]
        if values:
            wrong += [f"{f} in: {sentence}" for f in FIGURE.findall(sentence) if not is_recorded(f, values)]
    return wrong


def test_every_figure_readme_quotes_beside_a_benchmark_is_in_its_record():
    by_name = records()
    readme = (REPO / "README.md").read_text()
    assert {"lora_overhead", "moe", "quantized", "http_overhead"} <= {
        name for sentence in sentences(readme) for name in cited(sentence, set(by_name))
    }
    assert unrecorded_figures(readme, by_name) == []


def test_a_figure_no_named_record_holds_is_found():
    by_name = {  # records of its own, so that running the benchmarks again leaves this test as it is
        "moe": {"result": {"table": [{"tok/s vs base": 0.818, "rounds min..max": "0.813 .. 0.829"}]}},
        "http_overhead": {"result": {"table": [{"gateway vs direct": "0.922x"}, {"p50": "+101.9 ms"}]}},
    }
    text = (
        "Eight adapters decode at 0.818 of the base (`bench.moe`, rounds 0.813 to 0.829). "
        "They decode at 0.825 of it (`moe`). Elsewhere 0.825 names no record.\n\n"
        "- The gateway runs at 0.922x of direct, +101.9 ms at p50 (`bench.http_serving`)."
    )
    assert unrecorded_figures(text, by_name) == ["0.825 in: They decode at 0.825 of it (`moe`)."]

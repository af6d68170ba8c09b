"""bench.vocab_adapters: its ratio is the median of per-round ratios, and on a tiny model a whole
run writes a record and report section in which the vocabulary side changed the greedy tokens of
exactly the requests on adapters that have one (the plot needs matplotlib, which `make bench`
installs and the tests do not)."""

import json

from bench.record import measure, write_record
from bench.report import write_report
from bench.vocab_adapters import PLAIN, REQUESTS, VOCAB, summary, vocab_adapters


def test_the_ratio_is_the_median_of_per_round_ratios():
    rates = {PLAIN: [100.0, 200.0, 100.0], VOCAB: [80.0, 200.0, 91.0]}  # 0.8, 1.0 and 0.91 of plain
    changes = {"vocab": list(range(16)), "plain": []}
    result = summary(rates, changes, 3 * 2**20, repeats=3, prompt=16, tokens=64)
    plain, vocab = result["table"]
    assert (plain["decode tok/s"], plain["ratio to plain"]) == (100.0, 1.0)
    assert (vocab["decode tok/s"], vocab["ratio to plain"]) == (91.0, 0.91)
    assert vocab["ratio, rounds min..max"] == "0.800 .. 1.000"
    assert vocab["greedy tokens changed"] == "16 / 16 requests on vocabulary adapters, 0 / 16 on the others"
    assert "16 prompt + 64 new tokens" in result["setup"] and "(3.0 MiB each)" in result["setup"]
    assert "medians of 3 rounds" in result["setup"]


def test_a_run_on_a_tiny_model_changes_the_tokens_of_the_vocabulary_adapters_requests(tiny_models, tmp_path):
    record = measure(
        "vocab_adapters",
        "Vocabulary-side adapters",
        lambda: vocab_adapters(tiny_models["llama"], repeats=2, prompt=4, tokens=6),
        command="cmd",
        rerun="rerun",
    )
    write_record(tmp_path, record)
    report = write_report(tmp_path, ["vocab_adapters"]).read_text()

    result = json.loads((tmp_path / "vocab_adapters.json").read_text())["result"]
    assert [row["adapters"] for row in result["table"]] == [PLAIN, VOCAB]
    assert all(len(rates) == 2 and min(rates) > 0 for rates in result["decode_tok_s"].values())
    assert len(result["ratios"]) == 2
    # requests i go to adapter i % 8; adapters 0..3 carry the vocabulary side
    assert result["tokens_changed"] == {"vocab": [i for i in range(REQUESTS) if i % 8 < 4], "plain": []}
    assert "## Vocabulary-side adapters (`vocab_adapters`)" in report and "16 / 16 requests" in report

"""bench.structured: its decode ratio is the median of per-round ratios over the same full-batch
steps of both arms, and on the tiny chat model (random weights, the default tokenizer) a whole run
writes a record whose constrained outputs are JSON valid against the schema, whose cached
constraint was compiled once, and which has every figure the report shows."""

import json

import jsonschema

from bench.record import measure, write_record
from bench.structured import CONSTRAINED, HALF, NONE, SCHEMA, TTFT_CASES, structured, summary


def test_the_ratio_is_the_median_of_per_round_ratios():
    # 32 requests over a median step of 0.1 s: 320 tok/s; the constrained arm 0.8, 1.0 and 0.9 of it
    steps = {NONE: [[0.1, 0.1, 0.5]] * 3, HALF: [[0.125] * 3, [0.1] * 3, [0.1 / 0.9] * 3]}
    whole = {"texts": [], "tokens": [60, 70], "finish_reasons": [], "valid": [True, False]}
    ttft = {"seconds": {case: [0.05 + i] for i, case in enumerate(TTFT_CASES)}, "compiles_hits": []}
    masks = {"mask_rows_s": [0.002, 0.003], "grammar_s": [0.001, 0.001], "steps": 40}
    result = summary(steps, [3, 3, 3], whole, ttft, masks, repeats=3, tokens=48)
    rows = {row["figure"]: row for row in result["table"]}
    ratio = rows[f"decode ratio, {HALF} to {NONE}"]
    assert (ratio["value"], ratio["rounds min..max"]) == (0.9, "0.800 .. 1.000")
    assert rows[f"decode tok/s, {NONE}"]["value"] == 320.0
    assert rows["whole constrained outputs (round 0)"]["note"].startswith("of 2 valid")
    assert rows[f"time to first token ms, {TTFT_CASES[1]}"]["note"] == "+1000.0 ms to unconstrained"
    assert rows[f"mask_rows ms a step, {CONSTRAINED} of 32 rows"]["note"].startswith("0.025 of")
    assert "at most 48 new tokens" in result["setup"] and "medians of 3 rounds" in result["setup"]


def test_a_run_on_the_tiny_chat_model_records_valid_json_and_every_figure(tiny_chat_model, tmp_path):
    record = measure(
        "structured",
        "Structured outputs",
        lambda: structured(tiny_chat_model, repeats=1, tokens=12),
        command="cmd",
        rerun="rerun",
    )
    result = json.loads(write_record(tmp_path, record).read_text())["result"]

    assert len(result["table"]) == 4 + len(TTFT_CASES) + 2
    assert all(len(rates) == 1 and rates[0] > 0 for rates in result["decode_tok_s"].values())
    assert len(result["ratios"]) == 1 and result["full_batch_steps"][0] > 0
    assert all(len(seconds) == 1 for seconds in result["ttft_s"].values())
    assert result["ttft_compiles_hits"] == [[2, 1]]  # the schema once, again from the cache, a new one
    assert len(result["mask_rows_s"]) == len(result["grammar_mask_s"]) == 1
    whole = result["whole_outputs"]
    assert whole["finish_reasons"] == ["stop"] * CONSTRAINED and all(whole["valid"])
    for text in whole["texts"]:
        jsonschema.validate(json.loads(text), SCHEMA)

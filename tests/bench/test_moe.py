from bench.moe import BASE, MIXED, SEQUENCES, summary


def test_the_ratio_is_the_median_of_per_round_ratios():
    rounds = {BASE: [0.10, 0.20, 0.10], MIXED: [0.125, 0.20, 0.11]}  # 0.8, 1.0 and 0.909 of base
    result = summary(rounds, weight_bytes=2**30, repeats=3, steps=10)
    rows = {row["variant"]: row for row in result["table"]}
    assert rows[MIXED]["tok/s vs base"] == round(0.10 / 0.11, 3)
    assert rows[MIXED]["rounds min..max"] == "0.800 .. 1.000"
    assert rows[BASE]["ms / step"] == 100.0 and rows[BASE]["tok/s"] == SEQUENCES / 0.1
    assert "1.00 GiB of linear weights" in result["setup"]

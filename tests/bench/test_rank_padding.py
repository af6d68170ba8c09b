from bench.rank_padding import BASE, RANK8, SEQUENCES, summary


def test_ratios_are_medians_of_per_round_ratios():
    rounds = {  # seconds per step, 3 rounds; max_lora_rank=64 is 10% slower than 8 in rounds 1 and 3
        BASE: [0.10, 0.20, 0.10],
        RANK8: [0.20, 0.40, 0.20],
        "max_lora_rank=64": [0.22, 0.40, 0.22],
    }
    result = summary(rounds, repeats=3, steps=20)
    rows = {row["variant"]: row for row in result["table"]}
    assert rows[RANK8]["ratio to base"] == 0.5 and rows[RANK8]["ratio to max_lora_rank=8"] == 1.0
    assert rows["max_lora_rank=64"]["ratio to max_lora_rank=8"] == round(0.2 / 0.22, 3)
    assert rows["max_lora_rank=64"]["rounds min..max"] == f"{0.2 / 0.22:.3f} .. 1.000"
    assert rows[BASE]["ms / step"] == 100.0 and rows[BASE]["tok/s"] == SEQUENCES / 0.1
    assert "ratio to max_lora_rank=8" not in rows[BASE]

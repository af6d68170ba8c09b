from bench.tensor_parallel import BOTH_CORES, FULLY, ONE, SEQUENCES, SPLIT, summary


def test_ratios_are_to_one_rank_of_one_thread_and_the_exchange_share_is_rank_0s():
    rounds = {
        ONE: {"seconds": [2.0, 2.2, 2.0], "collective seconds": [0.0, 0.0, 0.0]},
        BOTH_CORES: {"seconds": [1.0, 1.1, 1.25], "collective seconds": [0.0, 0.0, 0.0]},
        SPLIT: {"seconds": [1.6, 1.1, 1.0], "collective seconds": [0.4, 0.2, 0.3]},
        FULLY: {"seconds": [2.0, 2.2, 2.5], "collective seconds": [1.0, 1.1, 1.0]},
    }
    result = summary(rounds, repeats=3, steps=32)
    rows = {row["variant"]: row for row in result["table"]}
    assert rows[SPLIT]["tok/s vs 1 rank, 1 thread"] == 2.0  # per round: 1.25, 2.0, 2.0
    assert rows[SPLIT]["rounds min..max"] == "1.250 .. 2.000"
    assert rows[SPLIT]["in exchanges"] == "25%"  # 25%, 18%, 30%
    assert rows[FULLY]["in exchanges"] == "50%"
    assert rows[ONE]["tok/s"] == round(SEQUENCES * 32 / 2.0, 1)
    assert "16 generated" not in result["setup"] and "32 generated" in result["setup"]

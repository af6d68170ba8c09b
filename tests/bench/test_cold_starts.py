import pytest

from bench.cold_starts import Run, gaps_within, streams_gaps, summary


def test_only_gaps_ending_inside_the_window_count():
    times = [0.0, 1.0, 1.5, 3.0, 3.25, 6.0]
    assert gaps_within(times, (1.2, 3.5)) == [0.5, 1.5, 0.25]
    assert gaps_within(times, (6.5, 7.0)) == []


def test_every_stream_must_outlast_the_window():
    streams = [[0.0, 1.0, 2.0, 4.0], [0.5, 1.5, 3.5]]
    assert streams_gaps(streams, (1.2, 3.5)) == [1.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="raise STREAM_TOKENS"):
        streams_gaps(streams, (1.2, 3.8))  # the second ended at 3.5


def test_summary_reports_medians_of_rounds_and_of_per_round_ratios():
    resident = [Run([0.1] * 99 + [0.2], [0.3, 0.3]), Run([0.1] * 100, [0.2, 0.4])]
    cold = [Run([0.2] * 100, [0.6, 0.9]), Run([0.1] * 100, [0.9, 0.9])]
    result = summary({"resident": resident, "cold": cold}, repeats=2)
    ttft, itl_p50, itl_p99 = result["table"]
    assert (ttft["value"], ttft["baseline value"]) == (825.0, 300.0)
    assert result["ratios"]["ttft p50"] == pytest.approx([2.5, 3.0])
    assert itl_p50["ratio"] == 1.5  # rounds: 2.0 and 1.0
    assert itl_p99["baseline value"] > 100.0  # round 1's one slow gap is its p99

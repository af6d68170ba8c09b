import pytest

from bench.http_serving import Run, summary


def test_summary_reports_medians_of_per_round_ratios_and_ttft_differences():
    direct = [Run(100.0, [0.1, 0.2, 0.3]), Run(200.0, [0.2, 0.2, 0.2]), Run(150.0, [0.1, 0.1, 0.9])]
    gateway = [Run(90.0, [0.1, 0.203, 0.4]), Run(100.0, [0.3, 0.3, 0.3]), Run(150.0, [0.1, 0.104, 0.9])]
    direct_alone = [Run(0.0, [0.10, 0.11]), Run(0.0, [0.12, 0.12]), Run(0.0, [0.10, 0.10])]
    gateway_alone = [Run(0.0, [0.11, 0.12]), Run(0.0, [0.12, 0.13]), Run(0.0, [0.10, 0.10])]
    runs = {
        "direct": direct,
        "gateway": gateway,
        "direct alone": direct_alone,
        "gateway alone": gateway_alone,
    }
    result = summary(runs, repeats=3)
    throughput, ttft, alone = result["table"]
    assert result["ratios"]["tok/s"] == pytest.approx([0.9, 0.5, 1.0])
    assert (throughput["value"], throughput["baseline value"]) == (100.0, 150.0)
    assert throughput["gateway vs direct"] == "0.900x"  # not 100 / 150: rounds are paired
    assert result["differences"]["ttft p50 s"] == pytest.approx([0.003, 0.1, 0.004])
    assert (ttft["value"], ttft["baseline value"]) == (203.0, 200.0)
    assert ttft["gateway vs direct"] == "+4.0 ms"
    assert result["differences"]["ttft p50 alone s"] == pytest.approx([0.01, 0.005, 0.0])
    assert alone["gateway vs direct"] == "+5.0 ms"

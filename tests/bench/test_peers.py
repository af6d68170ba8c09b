import argparse
import time
from pathlib import Path

import pytest
import torch

from bench import peers
from bench.hf_peft import Run
from bench.peers import (
    ADAPTERS,
    STEP_TOKENS,
    WARM_UP_TOKENS,
    CpuSample,
    Grid,
    cpu_jiffies,
    cpu_list,
    grid_from,
    loramux_engine,
    loramux_runner,
    others_cpus,
    peer_env,
    summary,
    time_cells,
    time_side,
    tree_jiffies,
)
from bench.report import markdown_table

VERSIONS = {"vllm": "0.32.0", "torch": "2.13.0+cpu"}


def args(*given: str) -> argparse.Namespace:
    parsed = {"quick": "--quick" in given, "dtypes": None, "prompts": None, "batches": None, "repeats": 3}
    parsed["base_only"] = "--base-only" in given
    parsed["decode_alone"] = "--decode-alone" in given
    if "--batches" in given:
        parsed["batches"] = [int(b) for b in given[given.index("--batches") + 1 :]]
    return argparse.Namespace(**parsed)


def test_the_default_grid_is_the_issues_with_bf16_only_where_the_cpu_has_it():
    assert grid_from(args(), {"avx2"}) == Grid(("float32",), (32, 512), (1, 8, 32, 128))
    assert grid_from(args(), {"avx512_bf16"}).dtypes == ("float32", "bfloat16")
    assert grid_from(args(), {"amx_bf16"}).dtypes == ("float32", "bfloat16")


def test_quick_is_one_fp32_cell_and_a_list_given_wins():
    assert grid_from(args("--quick"), {"avx512_bf16"}) == Grid(("float32",), (32,), (32,))
    assert grid_from(args("--quick", "--batches", "8", "128"), set()).batches == (8, 128)
    assert Grid(("float32",), (32, 512), (1,)).max_len == 512 + 32 + 16
    with pytest.raises(ValueError, match="float16"):
        Grid(("float16",), (32,), (32,))


def test_vllm_gets_this_process_cpus_as_ranges_and_the_preloads_before_any_already_set():
    assert cpu_list([1, 0]) == "0-1"
    assert cpu_list([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    env = peer_env({"PATH": "/bin", "LD_PRELOAD": "libx.so"}, [0, 1], 2, ["libtcmalloc_minimal.so.4"])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libx.so"
    assert "LD_PRELOAD" not in peer_env({}, [0], 1, [])


def cell(adapters: int, loramux: list[tuple[float, float]], vllm: list[tuple[float, float]]) -> dict:
    """A fake measured cell, batch 32, prompt 32: (seconds with 32 tokens, with 1) per round."""

    def side(rounds: list[tuple[float, float]]) -> dict:
        full, prefill = [f for f, _ in rounds], [p for _, p in rounds]
        quiet = {
            "others_cpus": [0.125] * len(rounds),
            "tries": [1] * len(rounds),
            "calls": [1] * len(rounds),
            "quiet_wait_s": [1.0] * len(rounds),
        }
        return {"full_s": full, "prefill_s": prefill, "outputs": [[1]]} | quiet

    key = {"dtype": "float32", "prompt": 32, "batch": 32, "adapters": adapters, "peer": VERSIONS}
    return key | {"loramux": side(loramux), "vllm": side(vllm)}


def test_the_table_has_decode_rates_their_ratios_per_round_and_adapters_over_base():
    # 32 x 31 = 992 decode tokens: 1 s of decode is 992 tok/s. loramux's rounds meet a machine
    # fast, slow, then in between: its adapters / base per round is 1/3, 3/4, 2/5, whose median (0.4)
    # the ratio of the arms' medians (248 / 496 = 0.5) is not.
    base = cell(0, [(2.0, 1.0), (4.0, 1.0), (3.0, 1.0)], [(2.0, 1.0), (2.0, 1.0), (1.5, 1.0)])
    mixed = cell(ADAPTERS, [(4.0, 1.0), (5.0, 1.0), (6.0, 1.0)], [(9.0, 1.0)] * 3)
    fp32 = {"0": {"loramux": 4, "vllm": 4}, "8": {"loramux": 4, "vllm": 3}, "ties": {}, "compared": {}}
    bf16 = {
        "0": {"loramux": 4, "vllm": 4},
        "8": {"loramux": 3, "vllm": 4},
        "ties": {"0": 1, "8": 2},
        "compared": {"0": 100, "8": 70},
    }
    agree = {"float32": fp32, "bfloat16": bf16, "checked": 4, "tokens": 32}
    grid = Grid(("float32",), (32,), (32,))
    result = summary([base, mixed], agree | {"batch": 32, "prompt": 32}, grid, [], (0.5, 1.25))
    (line,) = result["table"]
    assert (line["dtype"], line["prompt"], line["batch"]) == ("fp32", 32, 32)
    assert (line["loramux base tok/s"], line["vLLM base tok/s"]) == (496.0, 992.0)
    assert line["base loramux / vLLM"] == 0.33  # the median of the rounds' ratios 1, 1/3, 1/4
    assert (line["loramux 8 adapters tok/s"], line["vLLM 8 adapters tok/s"]) == (248.0, 124.0)
    assert line["8 adapters loramux / vLLM"] == 2.0  # 8/3, 2, 8/5
    assert (line["loramux adapters / base"], line["vLLM adapters / base"]) == (0.4, 0.125)
    fp32_text, bf16_text = result["setup"].split("Greedy tokens")[1:3]
    assert "loramux 4 / 4 base" in fp32_text and "vLLM 4 / 4 base, 3 / 4 with adapters" in fp32_text
    assert "first near tie" not in fp32_text
    assert "(requests cut at one: 1 base, 2 with adapters;" in bf16_text
    assert "tokens compared: 100 / 128 base, 70 / 128 with adapters)" in bf16_text
    assert "loramux 4 / 4 base, 3 / 4 with adapters" in bf16_text
    assert result["rounds"][0]["loramux"]["full_s"] == [2.0, 4.0, 3.0]
    assert "0 of 12 side-rounds timed again" in result["setup"]
    assert "Load average (1 min) 0.50 as the run began, 1.25 as it ended" in result["setup"]
    assert "| fp32 | 32 | 32 | 496.0 | 992.0 | 0.33 |" in markdown_table(result["table"])


def test_a_round_times_every_side_on_every_arm_in_an_order_reversed_every_other_round(monkeypatch):
    """Both arms' engines are alive together and their rounds interleave: each round meets the
    machine in the state the other arm's meets it in."""
    monkeypatch.setattr(peers, "wait_for_quiet", lambda: 0.0)
    monkeypatch.setattr(peers, "others_cpus", lambda before, after: 0.0)  # no round timed again
    monkeypatch.setattr(peers, "SETTLE_S", 0.0)
    calls: list[tuple[str, int, Path | None]] = []

    def runner(name: str):
        def run(prompts, adapters, tokens):
            calls.append((name, tokens, adapters[1]))
            return Run(float(len(calls)), [[tokens]] * len(prompts))

        return run

    folders = [Path(f"r16-{i}") for i in range(ADAPTERS)]
    arms = {a: {side: runner(f"{side} {a}") for side in ("loramux", "vllm")} for a in (0, ADAPTERS)}
    cells = time_cells(arms, 2, 32, folders, Grid(("float32",), (32,), (2,), repeats=2))
    order = ["loramux 0", "vllm 0", "loramux 8", "vllm 8"]
    assert [name for name, tokens, _ in calls if tokens == WARM_UP_TOKENS] == order
    timed = [name for name, tokens, _ in calls if tokens == 32]
    assert timed == order + order[::-1]
    assert {(name, adapter) for name, _, adapter in calls} == {
        ("loramux 0", None),
        ("vllm 0", None),
        ("loramux 8", folders[1]),
        ("vllm 8", folders[1]),
    }
    # calls 5-6 are base loramux's first round (32 tokens, then 1), 19-20 its second
    assert (cells[0]["loramux"]["full_s"], cells[0]["loramux"]["prefill_s"]) == ([5.0, 19.0], [6.0, 20.0])
    assert cells[ADAPTERS]["vllm"]["full_s"] == [11.0, 13.0]


def test_a_sides_calls_are_made_again_until_they_took_round_s_and_their_medians_kept(monkeypatch):
    """At batch 1 a side's two calls take well under a second, and one call's seconds moved by a
    fifth from round to round: its round makes them again until they took ROUND_S in all."""
    monkeypatch.setattr(peers, "wait_for_quiet", lambda: 0.0)
    monkeypatch.setattr(peers, "others_cpus", lambda before, after: 0.0)
    monkeypatch.setattr(peers, "SETTLE_S", 0.0)
    seconds = iter([0.9, 0.1, 0.5, 0.2, 0.7, 0.1, 0.6, 0.3, 5.0, 5.0])  # (32 tokens, 1) in turn
    asked = []

    def run(prompts, adapters, tokens):
        asked.append(tokens)
        return Run(next(seconds), [[tokens]])

    timed = time_side(run, [[1, 2]], [None], 32)
    assert asked == [32, 1] * 4  # 1.0, 1.7, 2.5, then 3.4 s: past ROUND_S (3 s)
    assert timed["calls"] == 4 and timed["outputs"] == [[32]]
    assert (timed["full_s"], timed["prefill_s"]) == (pytest.approx(0.65), pytest.approx(0.15))


def test_base_only_runs_the_base_arm_and_the_record_says_so():
    assert grid_from(args("--base-only"), set()).adapters is False and grid_from(args(), set()).adapters
    base = cell(0, [(2.0, 1.0)] * 3, [(3.0, 1.0)] * 3)
    fp32 = {"0": {"loramux": 4, "vllm": 4}, "ties": {}, "compared": {}}
    bf16 = {"0": {"loramux": 4, "vllm": 3}, "ties": {"0": 1}, "compared": {"0": 100}}
    agree = {"float32": fp32, "bfloat16": bf16, "checked": 4, "tokens": 32, "batch": 32, "prompt": 32}
    result = summary([base], agree, Grid(("float32",), (32,), (32,), adapters=False), [], (0.5, 1.25))
    (line,) = result["table"]
    assert line == {
        "dtype": "fp32", "prompt": 32, "batch": 32,
        "loramux base tok/s": 992.0, "vLLM base tok/s": 496.0, "base loramux / vLLM": 2.0,
    }  # fmt: skip
    assert "EOS ignored; the base model alone (no adapters arm: --base-only)." in result["setup"]
    assert "adapters / base" not in result["setup"] and "slots of rank" not in result["setup"]
    fp32_text, bf16_text = result["setup"].split("Greedy tokens")[1:3]
    assert "loramux 4 / 4 base; vLLM 4 / 4 base." in fp32_text
    assert "(requests cut at one: 1 base; tokens compared: 100 / 128 base)" in bf16_text
    assert "loramux 4 / 4 base; vLLM 3 / 4 base." in bf16_text


def test_busy_jiffies_leave_out_idle_and_iowait():
    proc_stat = "cpu  100 5 20 1000 30 1 2 3 0 0\ncpu0 50 0 10 500 15 0 1 1 0 0\n"
    assert cpu_jiffies(proc_stat) == (131, 1161)


def test_other_work_is_the_machines_less_this_process_trees(monkeypatch):
    processes = {1: (0, 1000), 10: (1, 5), 11: (10, 7), 12: (11, 11), 20: (1, 100)}
    assert tree_jiffies(processes, 10) == 5 + 7 + 11
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # 100 busy jiffies of 200 (2 CPUs over 100 ticks), 60 of them ours: 40 / 100 = 0.4 CPUs
    assert others_cpus(CpuSample(0, 0, 0), CpuSample(100, 200, 60)) == 0.4
    assert others_cpus(CpuSample(0, 0, 0), CpuSample(50, 200, 60)) == 0.0


def test_decode_alone_takes_every_prompt_in_one_step_on_both_sides():
    grid = grid_from(args("--decode-alone"), set())
    assert grid.decode_alone and grid.step_tokens(32) == 32 * (512 + 32 + 16)
    assert grid_from(args(), set()).step_tokens(32) == STEP_TOKENS


def test_decode_alone_times_the_call_alone_and_keeps_the_median_decode_seconds(monkeypatch):
    monkeypatch.setattr(peers, "wait_for_quiet", lambda: 0.0)
    monkeypatch.setattr(peers, "others_cpus", lambda before, after: 0.0)
    monkeypatch.setattr(peers, "SETTLE_S", 0.0)
    made = iter([(1.2, 0.4), (1.0, 0.2), (0.9, 0.3), (5.0, 5.0)])  # (seconds, decode_s)
    asked = []

    def run(prompts, adapters, tokens):
        asked.append(tokens)
        seconds, decode = next(made)
        return Run(seconds, [[tokens]], decode)

    timed = time_side(run, [[1, 2]], [None], 32, alone=True)
    assert asked == [32] * 3  # 1.2, 2.2, then 3.1 s: past ROUND_S, and no 1-token call
    assert (timed["full_s"], timed["decode_s"]) == (1.0, 0.3) and "prefill_s" not in timed


def test_decode_alone_rates_divide_by_the_decode_seconds_and_the_record_says_how():
    base = cell(0, [(2.0, 1.0)] * 3, [(3.0, 1.0)] * 3)
    for side, decode in (("loramux", [1.0, 0.5, 2.0]), ("vllm", [2.0, 2.0, 2.0])):
        base[side]["decode_s"] = decode
        del base[side]["prefill_s"]
    agree = {
        "float32": {"0": {"loramux": 4, "vllm": 4}, "ties": {}, "compared": {}},
        "checked": 4,
        "tokens": 32,
    }
    grid = Grid(("float32",), (32,), (32,), adapters=False, decode_alone=True)
    result = summary([base], agree | {"batch": 32, "prompt": 32}, grid, [], (0.5, 1.25))
    (line,) = result["table"]
    # 992 decode tokens over 1, 0.5 and 2 s against 2 s each: ratios 2, 4, 1
    assert (line["loramux base tok/s"], line["vLLM base tok/s"], line["base loramux / vLLM"]) == (
        992.0,
        496.0,
        2.0,
    )
    assert result["rounds"][0]["loramux"]["decode_s"] == [1.0, 0.5, 2.0]
    assert "every prompt in one step (batch x 80 tokens a step: --decode-alone)" in result["setup"]
    assert "from the last request's first token to the last token" in result["setup"]
    assert "its call made again" in result["setup"] and "1-token call" not in result["setup"]


def test_loramux_decode_seconds_are_the_steps_after_every_first_token(tiny_models):
    """In one step every prompt draws its first token; decode_s spans the steps after it."""
    engine = loramux_engine(tiny_models["llama"], "float32", 4, 64, [], step_tokens=4 * 64)
    spans: list[tuple[float, float]] = []
    step = engine.runner.run

    def timed(chunks):
        start = time.perf_counter()
        out = step(chunks)
        spans.append((start, time.perf_counter()))
        return out

    engine.runner.run = timed
    prompts = [[5 + i] * (3 + 2 * i) for i in range(4)]
    with torch.inference_mode():
        ran = loramux_runner(engine)(prompts, [None] * 4, 6)
    assert [len(o) for o in ran.outputs] == [6] * 4 and len(spans) == 6  # a prefill step, 5 decode steps
    prefill, decode_steps = spans[0][1] - spans[0][0], sum(end - start for start, end in spans[1:])
    assert decode_steps <= ran.decode_s < ran.seconds - prefill

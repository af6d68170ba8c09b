from collections import Counter

from bench.many_adapters import (
    HOT,
    HOT_CASE,
    MAX_NEW,
    MIN_NEW,
    PROMPT,
    REQUESTS,
    TARGETS,
    ZIPF,
    CaseRound,
    StepRecord,
    Workload,
    counters,
    engine_with,
    summary,
    window,
    workload,
    zipf_draws,
)
from bench.random_adapter import write_random_adapter
from shared.model_config import ModelConfig


def test_zipf_draws_repeat_for_a_seed_and_differ_across_seeds():
    assert zipf_draws(100, 1000, 1.0, seed=3) == zipf_draws(100, 1000, 1.0, seed=3)
    assert zipf_draws(100, 1000, 1.0, seed=3) != zipf_draws(100, 1000, 1.0, seed=4)


def test_zipf_popularity_falls_as_one_over_rank():
    counts = Counter(zipf_draws(50_000, 1000, 1.0, seed=0))
    assert counts[0] > counts[1] > counts[3] > counts[7] > counts[63]
    assert 1.8 < counts[0] / counts[1] < 2.2  # p(k) proportional to 1/k
    assert 0.12 < counts[0] / 50_000 < 0.15  # 1 / H(1000) = 0.134
    assert max(counts) < 1000


def test_both_cases_send_the_same_prompts_and_lengths():
    load = workload(seed=1, vocab_size=500)
    assert len(load.prompts) == len(load.new_tokens) == REQUESTS
    assert all(len(p) == PROMPT and all(0 <= t < 500 for t in p) for p in load.prompts)
    assert all(MIN_NEW <= n <= MAX_NEW for n in load.new_tokens)
    assert set(load.adapters[HOT_CASE]) == {f"a{i}" for i in range(HOT)}
    assert len(load.adapters[ZIPF]) == REQUESTS
    assert len(set(load.adapters[ZIPF])) > HOT


def test_a_window_counts_its_steps_tokens_over_the_time_to_its_last_step():
    steps = [
        StepRecord(0.0, 1.0, 4, ("a0", "a0", "a1", "a2"), saturated=True),
        StepRecord(1.0, 1.5, 0, (), saturated=True),  # waited for a load
        StepRecord(1.5, 2.0, 2, ("a1", "a1"), saturated=True),
    ]
    assert window(steps, "round ") == {
        "round tok/s": 3.0,
        "round seconds": 2.0,
        "round running per step": 3.0,  # the step that ran nothing is not averaged in
        "round adapters per step": 2.0,
    }


def test_the_saturated_window_ends_where_requests_were_no_longer_left_to_submit():
    rounds = {ZIPF: [], HOT_CASE: []}
    for case, tail in ((ZIPF, 1), (HOT_CASE, 2)):  # the hot case drains twice as fast
        for seconds in (1.0, 2.0, 1.0):
            steps = [StepRecord(0.0, seconds, 32, ("a0",) * 32, saturated=True)]
            steps.append(StepRecord(seconds, seconds + 2 / tail, 8, ("a1",) * 8, saturated=False))
            rounds[case].append(run_figures(steps))
    rows = {row["case"]: row for row in summary(rounds, repeats=3)["table"]}
    assert rows[ZIPF]["ratio to hot"] == 1.0 and rows[ZIPF]["running / step"] == 32.0
    assert rows[ZIPF]["whole round, ratio to hot"] == round((40 / 3) / (40 / 2), 3)
    assert rows[HOT_CASE]["tok/s, saturated"] == 32.0 and rows[HOT_CASE]["tok/s, whole round"] == 20.0


def run_figures(steps: list[StepRecord]) -> dict[str, float]:
    """What `run` returns for these steps, without an engine (counters all 1)."""
    counters = ("hit rate", "requests held", "loads", "reloads", "distinct adapters", "activations")
    figures = {key: 1.0 for key in (*counters, "host evictions", "load ms", "idle s", "load wait s")}
    return {**window([s for s in steps if s.saturated], ""), **window(steps, "round "), **figures}


def test_registered_adapters_load_when_first_named_and_serve_their_requests(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    model = ModelConfig.from_dir(model_dir)
    folders = [write_random_adapter(model, tmp_path / f"a{i}", r, i, TARGETS) for i, r in enumerate((8, 64))]
    engine = engine_with(model_dir, folders)
    assert engine.held_digests() == {}  # registered, none read into the host tier yet
    load = Workload([[1, 2, 3]] * 4, [2, 3, 2, 3], {"case": ["a0", "a1", "a1", "a0"]})
    case = CaseRound(engine, load.adapters["case"], load)
    while not case.done:
        case.block(4)
    assert sum(step.tokens for step in case.steps) == 10  # every request's tokens
    assert counters(engine)["misses"] == 2  # one load for each adapter, when first named
    assert set(engine.held_digests()) == {"a0", "a1"}

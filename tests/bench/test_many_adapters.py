from collections import Counter

from bench.many_adapters import HOT, HOT_CASE, MAX_NEW, MIN_NEW, PROMPT, REQUESTS, ZIPF, workload, zipf_draws


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

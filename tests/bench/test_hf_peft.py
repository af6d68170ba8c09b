from bench.hf_peft import ADAPTERS, FIRST_ORDINARY_ID, OUTPUT_LENS, PROMPT_LENS, REQUESTS, summary, workload

VOCAB = 49152


def test_workload_is_the_same_mix_every_time_with_varied_lengths_and_no_special_tokens():
    jobs = workload(VOCAB)
    assert jobs == workload(VOCAB)
    assert jobs != workload(VOCAB, seed=1)
    assert len(jobs) == REQUESTS
    assert [job.adapter for job in jobs[:ADAPTERS]] * (REQUESTS // ADAPTERS) == [job.adapter for job in jobs]
    assert len({len(job.prompt) for job in jobs}) > 1 and len({job.tokens for job in jobs}) > 1
    assert all(PROMPT_LENS[0] <= len(job.prompt) <= PROMPT_LENS[1] for job in jobs)
    assert all(OUTPUT_LENS[0] <= job.tokens <= OUTPUT_LENS[1] for job in jobs)
    assert all(FIRST_ORDINARY_ID <= i < VOCAB for job in jobs for i in job.prompt)


def test_summary_ratio_is_the_median_of_per_round_ratios_and_counts_useful_tokens():
    jobs = workload(VOCAB)
    values = {"loramux": [100.0, 300.0, 200.0], "hf_peft": [50.0, 100.0, 200.0]}
    result = summary(values, [32, 31, 32], jobs, repeats=3)
    assert result["ratios"] == [2.0, 3.0, 1.0]
    rates, tokens, identical = result["table"]
    assert (rates["value"], rates["baseline value"], rates["ratio"]) == (200.0, 100.0, 2.0)
    assert tokens["value"] == sum(job.tokens for job in jobs)
    assert tokens["baseline value"] == REQUESTS * max(job.tokens for job in jobs)
    assert identical["value"] == f"31 / {REQUESTS}"

"""bench.kv_pressure's driver on a tiny model: each request ends at its drawn length, every step is
counted, and preemptions reach the figures."""

from bench import kv_pressure
from inference_service.engine import Request
from inference_service.sampling import SamplingParams


def test_requests_end_at_their_lengths_and_every_step_is_counted(tiny_models):
    engine = kv_pressure.engine(tiny_models["llama"], kv_tokens=256, max_num_seqs=8, max_model_len=64)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [Request([5 + i] * 10, None, params, f"r{i}") for i in range(4)]

    run = kv_pressure.drive(engine, requests, [3, 5, 7, 9])

    assert run.tokens == 3 + 5 + 7 + 9  # each aborted before a step past its length
    assert len(run.computed) == len(run.running)  # one entry per engine step
    assert run.computed[0] == 40 and run.running[-1] == 0  # 4 prompts in the first step; none left
    assert 0 < run.decode_seconds < run.seconds and run.preemptions == [0, 0, 0, 0]


def test_an_oversubscribed_cache_preempts_and_every_request_still_finishes(tiny_models):
    engine = kv_pressure.engine(tiny_models["llama"], kv_tokens=64, max_num_seqs=8, max_model_len=64)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [Request([5 + i] * 16, None, params, f"r{i}") for i in range(4)]  # 56 positions each

    run = kv_pressure.drive(engine, requests, None)

    assert run.tokens == 4 * 40 and sum(run.preemptions) > 0 and run.preemptions[0] == 0
    assert all(run.computed)  # no step without progress

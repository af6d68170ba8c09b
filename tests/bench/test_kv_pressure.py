"""bench.kv_pressure's driver on a tiny model: each request ends at its drawn length, every step is
counted, and preemptions reach the figures."""

from bench import kv_pressure
from inference_service.engine import Request
from inference_service.sampling import SamplingParams


def test_requests_end_at_their_lengths_and_every_step_is_counted(tiny_models):
    engine = kv_pressure.engine(tiny_models["llama"], kv_tokens=256, max_num_seqs=8, max_model_len=64)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [Request([5 + i] * 10, None, params, f"r{i}") for i in range(4)]

    run = kv_pressure.drive({"one": engine}, requests, [3, 5, 7, 9])["one"]

    assert run.tokens == 3 + 5 + 7 + 9  # each aborted before a step past its length
    assert len(run.computed) == len(run.running)  # one entry per engine step
    assert run.computed[0] == 40 and run.running[-1] == 0  # 4 prompts in the first step; none left
    assert 0 < run.decode_seconds < run.seconds and run.preemptions == [0, 0, 0, 0]


def test_an_oversubscribed_cache_preempts_and_every_request_still_finishes(tiny_models):
    engine = kv_pressure.engine(tiny_models["llama"], kv_tokens=64, max_num_seqs=8, max_model_len=64)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [Request([5 + i] * 16, None, params, f"r{i}") for i in range(4)]  # 56 positions each

    run = kv_pressure.drive({"one": engine}, requests, None)["one"]

    assert run.tokens == 4 * 40 and sum(run.preemptions) > 0 and run.preemptions[0] == 0
    assert all(run.computed)  # no step without progress


def test_engines_in_lock_step_each_run_every_request(tiny_models):
    engines = {n: kv_pressure.engine(tiny_models["llama"], 256, n, 64) for n in (2, 8)}  # max_num_seqs
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [Request([5 + i] * 10, None, params, f"r{i}") for i in range(4)]

    runs = kv_pressure.drive(engines, requests, [3, 5, 7, 9])

    assert runs[2].tokens == runs[8].tokens == 24
    assert (max(runs[2].running), max(runs[8].running)) == (2, 4)
    assert len(runs[2].running) > len(runs[8].running)  # two at a time take more steps

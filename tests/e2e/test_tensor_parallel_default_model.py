"""The default model (SmolLM2-135M: 9 heads, 3 KV heads) through a worker over 3 tensor-parallel
ranks, fetching adapters from a real store: under a KV cache too small for its requests
(preemption), memory for one adapter on the device and one in host memory (evictions), a prompt
repeated (the prefix cache) and an adapter re-registered between requests, every request's greedy
tokens equal those of the in-process engine on one device. On fewer than 3 CPUs its log says the
ranks crowd them."""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench.random_adapter import write_random_adapter
from inference_service.demo.demo import DEMO_ADAPTERS
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig
from shared.pb.loramux.inference.v1 import inference_pb2 as pb
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as store_grpc
from tests.adapter_store.conftest import AUTH, StoreProcess, local_store_flags
from tests.e2e.conftest import WorkerProcess, register
from tests.e2e.test_worker_e2e import _request, _tokens

TOKENS = 20
TOPICS = ["the sea", "a city", "music", "the moon"]
# "voice" holds the demo's pirate adapter, then is re-registered with its shouty one; "r1" is random
OWNERS = ["voice", "r1", "shouty", None]
CONTENT = {"voice": "pirate", "r1": "r1", "shouty": "shouty"}


@pytest.fixture(scope="module")
def sources(default_model_dir, tmp_path_factory):
    """The demo adapters (trained: they change the default model's words) and a random one."""
    root = tmp_path_factory.mktemp("tp-default-sources")
    for name in ("shouty", "pirate"):
        shutil.copytree(DEMO_ADAPTERS / name, root / name)
    write_random_adapter(ModelConfig.from_dir(default_model_dir), root / "r1", rank=8, seed=1)
    return root


def _prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(f"Write one sentence about {topic}, and say why people have always cared about it.")
        for topic in TOPICS
    ]


def _in_process(
    default_model_dir, sources, requests: list[tuple[list[int], str | None]], content: dict
) -> list:
    """Each request's greedy tokens from the engine on one device; content: name -> folder."""
    engine = Engine(EngineConfig(model=str(default_model_dir), kv_cache_tokens=4096, max_model_len=256))
    for name, folder in content.items():
        engine.add_adapter(name, sources / folder)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return [out.token_ids for out in engine.generate([Request(p, a, params) for p, a in requests])]


def test_three_ranks_give_the_default_models_tokens_through_pressure_and_a_re_register(
    default_model_dir, sources, tmp_path, tokenizer
):
    store = StoreProcess(tmp_path / "store", local_store_flags(sources, default_model_dir)).start()
    flags = ("--tensor-parallel-size", "3", "--kv-cache-tokens", "96", "--max-model-len", "64")
    flags += ("--max-loras", "1", "--max-cpu-loras", "1")
    worker = None
    try:
        with grpc.insecure_channel(store.address) as channel:
            admin = store_grpc.AdapterStoreStub(channel)
            for name, folder in CONTENT.items():
                register(admin, name, f"file://{sources / folder}")
            worker = WorkerProcess(default_model_dir, store.address, tmp_path / "cache", *flags).start()
            got, repeated, again, stats = _serve(worker, admin, sources, _prompts(tokenizer))
    finally:
        if worker is not None:
            worker.terminate()
        store.stop()
    assert worker.wait() == 0
    prompts = _prompts(tokenizer)
    # voice re-registered holds shouty's content: one engine answers for both
    requests = [*zip(prompts, OWNERS, strict=True), (prompts[0], "shouty")]
    expected = _in_process(default_model_dir, sources, requests, CONTENT)
    assert (got, again) == (expected[:-1], expected[-1:])
    assert repeated == (got[0], 16)  # the first block of 16 prompt tokens from the cache
    assert stats.num_preemptions > 0 and stats.slot_evictions > 0 and stats.host_evictions > 0
    assert [r.rank for r in stats.ranks] == [0, 1, 2]
    assert ("tensor_parallel_size 3 on" in worker.log.read_text()) == ((os.cpu_count() or 1) < 3)


def _serve(worker, admin, sources, prompts):
    """The requests at once; the first one's twice more, one after the other (the second finds
    the first's blocks in the prefix cache: its tokens and cached tokens); then "voice"
    re-registered with new content and asked again."""
    with grpc.insecure_channel(worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        requests = [_request(a, p, TOKENS, ignore_eos=True) for p, a in zip(prompts, OWNERS, strict=True)]
        with ThreadPoolExecutor(len(requests)) as pool:
            got = [tokens for tokens, _ in pool.map(lambda r: _tokens(stub, r), requests)]
        _tokens(stub, requests[0])
        tokens, final = _tokens(stub, requests[0])
        repeated = (tokens, final.usage.cached_tokens)
        admin.DeleteAdapter(store_pb.DeleteAdapterRequest(adapter_id="voice"), metadata=AUTH)
        register(admin, "voice", f"file://{sources / 'shouty'}")
        again = _until_new_content(stub, prompts[0], got[0])
        return got, repeated, again, stub.GetStats(pb.GetStatsRequest())


def _until_new_content(stub, prompt: list[int], old: list[int]) -> list[list[int]]:
    """voice's tokens for `prompt` once the worker follows the re-register (the store's watch)."""
    for _ in range(20):
        tokens, _ = _tokens(stub, _request("voice", prompt, TOKENS, ignore_eos=True))
        if tokens != old:
            return [tokens]
    pytest.fail("the worker still serves voice's old content")

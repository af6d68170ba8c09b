"""Vocabulary-side adapters on the default model (SmolLM2-135M, tied embeddings) through a real store
and worker: one with LoRA on embed_tokens and lm_head (PEFT saves both base-layer copies beside
it: the store checks them against the base model and drops them), one with its own lm_head
(modules_to_save: 49152 x 576 floats), served beside the demo adapters and the base model in
one batch. Every request's greedy tokens equal the in-process engine's; ListAdapters counts the
parts' bytes."""

import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from inference_service.demo.demo import DEMO_ADAPTERS
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as store_grpc
from tests.adapter_store.conftest import AUTH, StoreProcess, local_store_flags
from tests.e2e.conftest import WorkerProcess, register
from tests.e2e.test_worker_e2e import _request, _tokens
from tests.inference_service.model.test_vocab_reference import build_vocab_adapter

TOKENS = 16
HEAD_BYTES = 49152 * 576 * 4  # the default model's head in float32
ADAPTER_MEMORY = str(256 << 20)
VOCAB = {
    "vocab_lora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"]),
    "own_head": dict(r=4, lora_alpha=8, target_modules=["o_proj"], modules_to_save=["lm_head"]),
}
OWNERS = ["vocab_lora", "pirate", "own_head", None, "shouty", "vocab_lora"]
TOPICS = ["the sea", "a city", "music", "the moon", "a river", "bread"]


@pytest.fixture(scope="module")
def sources(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-sources")
    for name in ("shouty", "pirate"):
        shutil.copytree(DEMO_ADAPTERS / name, root / name)
    for i, (name, lora) in enumerate(VOCAB.items()):
        build_vocab_adapter(default_model_dir, root / name, seed=i + 1, **lora)
    return root


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(f"Write one sentence about {topic}.") for topic in TOPICS]


def _in_process(default_model_dir, sources, prompts) -> list[list[int]]:
    config = EngineConfig(model=str(default_model_dir), adapter_memory=int(ADAPTER_MEMORY), max_model_len=256)
    engine = Engine(config)
    for name in ("shouty", "pirate", *VOCAB):
        engine.add_adapter(name, sources / name)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return [
        o.token_ids
        for o in engine.generate([Request(p, a, params) for p, a in zip(prompts, OWNERS, strict=True)])
    ]


def test_embedding_and_head_adapters_are_served_beside_the_demo_ones(
    default_model_dir, sources, tmp_path, tokenizer
):
    store = StoreProcess(tmp_path / "store", local_store_flags(sources, default_model_dir)).start()
    worker = None
    try:
        with grpc.insecure_channel(store.address) as channel:
            admin = store_grpc.AdapterStoreStub(channel)
            for name in ("shouty", "pirate", *VOCAB):
                register(admin, name, f"file://{sources / name}")
            listed = {
                a.adapter_id: a
                for a in admin.ListAdapters(store_pb.ListAdaptersRequest(), metadata=AUTH).adapters
            }
            worker = WorkerProcess(
                default_model_dir, store.address, tmp_path / "cache", "--adapter-memory", ADAPTER_MEMORY
            ).start()
            got = _serve(worker, _prompts(tokenizer))
    finally:
        if worker is not None:
            worker.terminate()
        store.stop()
    assert got == _in_process(default_model_dir, sources, _prompts(tokenizer))
    assert len({tuple(t) for t in got}) == len(got)  # every adapter (and the base) says something else
    assert listed["own_head"].size_bytes > HEAD_BYTES > 20 * listed["pirate"].size_bytes
    assert list(listed["vocab_lora"].target_modules) == ["q_proj", "v_proj", "embed_tokens", "lm_head"]
    # q and v of 30 layers, A and B^T of embed_tokens and lm_head, rank 8, float32; then the header
    tensors = 4 * 8 * (30 * (576 + 576 + 576 + 192) + 2 * (49152 + 576))
    assert tensors < listed["vocab_lora"].size_bytes < tensors + (64 << 10)


def _serve(worker, prompts) -> list[list[int]]:
    with grpc.insecure_channel(worker.address) as channel:
        stub = inference_grpc.InferenceServiceStub(channel)
        requests = [_request(a, p, TOKENS, ignore_eos=True) for p, a in zip(prompts, OWNERS, strict=True)]
        with ThreadPoolExecutor(len(requests)) as pool:
            return [tokens for tokens, _ in pool.map(lambda r: _tokens(stub, r), requests)]

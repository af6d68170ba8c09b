"""Vocabulary-side adapters (LoRA on embed_tokens and lm_head, trainable tokens, modules_to_save
copies) registered through the real store process: good ones are stored with every vocabulary
part in their blob; hostile variants are refused with their status code and a message naming the
tensor or setting at fault, nothing of them is stored, and the store keeps serving afterwards."""

import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from shared import adapter_blob
from shared.base_vocab import BaseVocab
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc
from shared.peft_checkpoint import load_peft_adapter
from tests.adapter_store.conftest import AUTH, StoreProcess, store_flags, upload_folder
from tests.adapter_store.test_hostile_corpus import _config, _tensors
from tests.inference_service.model.test_vocab_reference import build_vocab_adapter

EMBED, HEAD = "base_model.model.model.embed_tokens", "base_model.model.lm_head"
DELTA = f"{EMBED}.token_adapter.trainable_tokens_delta"
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
TOKENS = [5, 17, 33, 101]

# name -> (PEFT LoraConfig kwargs, the vocabulary-side tensors its blob holds)
GOOD = {
    "lora": (
        dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"]),
        {"embed_tokens.lora_a", "embed_tokens.lora_b_t", "lm_head.lora_a", "lm_head.lora_b_t"},
    ),
    "tokens": (
        dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=TOKENS),
        {"embed_tokens.token_rows"},
    ),
    "own_head": (
        dict(r=4, lora_alpha=8, target_modules=["o_proj"], modules_to_save=["lm_head"]),
        {"lm_head.weight"},
    ),
    "own_embed": (
        dict(r=4, lora_alpha=8, target_modules=["v_proj"], modules_to_save=["embed_tokens"]),
        {"embed_tokens.weight"},
    ),
}


def _set(key: str, value):
    """Tensor `key` replaced by value(its old value)."""
    return _tensors(lambda t: t.__setitem__(key, value(t[key])))


def _add(key: str, tensor: torch.Tensor):
    return _tensors(lambda t: t.__setitem__(key, tensor))


def _both(*edits):
    def edit(folder: Path) -> None:
        for one in edits:
            one(folder)

    return edit


def _poison(value: float):
    def change(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[3, 1] = value
        return t

    return change


def _nudged(t: torch.Tensor) -> torch.Tensor:
    """One value of a base-layer copy moved: the copy of another base model."""
    t = t.clone()
    t[11, 5] += 0.25
    return t


def _new_embeddings(folder: Path) -> None:
    save_file(
        {"base_model.model.model.embed_tokens": torch.randn(8, 64)}, folder / "new_embeddings.safetensors"
    )


# name -> (good adapter it edits, the edit, words the INVALID_ARGUMENT message must hold)
CORPUS = {
    "embed-lora-rank": (
        "lora",
        _set(f"{EMBED}.lora_embedding_A", lambda t: t[:3].clone()),
        ("model.embed_tokens", "lora_embedding_A [3, 160]", "lora_embedding_B [64, 4]", "rank"),
    ),
    "head-lora-hidden": (
        "lora",
        _set(f"{HEAD}.lora_A.weight", lambda t: torch.randn(4, 65)),
        ("lm_head.lora_A.weight", "[4, 65]", "hidden size is 64"),
    ),
    "tokens-out-of-range": (
        "tokens",
        _config(trainable_token_indices=[5, 17, 33, 160]),
        ("trainable_token_indices", "160", "0..159"),
    ),
    "tokens-duplicated": (
        "tokens",
        _config(trainable_token_indices=[5, 17, 17, 101]),
        ("trainable_token_indices", "token 17 twice"),
    ),
    "tokens-delta-rows": (
        "tokens",
        _set(DELTA, lambda t: t[:3].clone()),
        ("model.embed_tokens.token_adapter.trainable_tokens_delta", "3 rows", "4 tokens"),
    ),
    "head-base-copy-tampered": (
        "lora",
        _set(f"{HEAD}.base_layer.weight", _nudged),
        ("lm_head.base_layer.weight", "differs from the base model's"),
    ),
    "embed-base-copy-tampered": (
        "lora",
        _set(f"{EMBED}.base_layer.weight", _nudged),
        ("model.embed_tokens.base_layer.weight", "differs from the base model's"),
    ),
    "resized-embed-copy": (
        "own_embed",
        _set(f"{EMBED}.weight", lambda t: torch.cat([t, torch.randn(8, 64)])),
        ("model.embed_tokens.weight", "168", "160", "resize"),
    ),
    "resized-head-lora": (
        "lora",
        _both(
            _set(f"{HEAD}.lora_B.weight", lambda t: torch.cat([t, torch.randn(8, 4)])),
            _set(f"{HEAD}.base_layer.weight", lambda t: torch.cat([t, torch.randn(8, 64)])),
        ),
        ("lm_head.", "168", "160", "resize"),
    ),
    "new-embeddings-file": (
        "tokens",
        _new_embeddings,
        ("new_embeddings.safetensors", "added to the vocabulary"),
    ),
    "saves-norm": (
        "own_head",
        _both(
            _config(modules_to_save=["lm_head", "model.norm"]),
            _add("base_model.model.model.norm.weight", torch.ones(64)),
        ),
        ("modules_to_save", "'model.norm'"),
    ),
    "saves-score": ("own_head", _config(modules_to_save=["score"]), ("modules_to_save", "'score'")),
    "nan-head-lora": (
        "lora",
        _set(f"{HEAD}.lora_B.weight", _poison(float("nan"))),
        ("lm_head.lora_B.weight", "NaN"),
    ),
    "inf-token-rows": ("tokens", _set(DELTA, _poison(float("inf"))), ("trainable_tokens_delta", "Inf")),
    "nan-own-head": ("own_head", _set(f"{HEAD}.weight", _poison(float("nan"))), ("lm_head.weight", "NaN")),
    "unknown-embed-part": (
        "lora",
        _add(f"{EMBED}.lora_A.weight", torch.randn(4, 160)),
        ("model.embed_tokens.lora_A.weight", "none of the parts of embed_tokens"),
    ),
    "undeclared-head-copy": (
        "own_head",
        _config(modules_to_save=None),
        ("lm_head.weight", "modules_to_save does not name lm_head"),
    ),
    "undeclared-embed-lora": (
        "lora",
        _config(target_modules=["q_proj", "lm_head"]),
        ("model.embed_tokens.lora_embedding_A", "target_modules", "does not name embed_tokens"),
    ),
    "two-kinds-on-head": (
        "lora",
        _both(_config(modules_to_save=["lm_head"]), _add(f"{HEAD}.weight", torch.randn(160, 64))),
        ("lm_head has both LoRA and modules_to_save",),
    ),
}
S3_HOSTILE = (
    "embed-lora-rank",
    "tokens-out-of-range",
    "new-embeddings-file",
)
S3_GOOD = ("lora", "tokens")


@pytest.fixture(scope="module")
def good(sources_root, tiny_models) -> dict[str, Path]:
    """The good adapters' folders, under the store's allowed root."""
    return {
        name: build_vocab_adapter(tiny_models["llama"], sources_root / "vocab" / name, seed=i + 1, **lora)
        for i, (name, (lora, _)) in enumerate(GOOD.items())
    }


@pytest.fixture(scope="module")
def corpus(sources_root, good) -> dict[str, Path]:
    folders = {}
    for name, (kind, edit, _) in CORPUS.items():
        folder = Path(shutil.copytree(good[kind], sources_root / "vocab-corpus" / name))
        edit(folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def vocab_store(tmp_path_factory, sources_root, s3_endpoint, tiny_models):
    flags = store_flags(sources_root, s3_endpoint, tiny_models)
    process = StoreProcess(tmp_path_factory.mktemp("vocab-store"), flags).start()
    yield process
    assert process.stop() == 0


@pytest.fixture
def stub(vocab_store):
    with grpc.insecure_channel(vocab_store.address) as channel:
        yield pb_grpc.AdapterStoreStub(channel)


def _register(stub, adapter_id: str, uri: str):
    request = pb.RegisterAdapterRequest(adapter_id=adapter_id, source_uri=uri)
    return stub.RegisterAdapter(request, metadata=AUTH)


def _fetch(stub, adapter_id: str) -> bytes:
    responses = stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=adapter_id))
    return b"".join(r.chunk for r in list(responses)[1:])


def _assert_refused(stub, adapter_id: str, uri: str, words: tuple[str, ...]) -> None:
    """Refused: a copy of the base's weights that is not the base's is an adapter of another base
    model (FAILED_PRECONDITION), every other defect a bad checkpoint (INVALID_ARGUMENT)."""
    with pytest.raises(grpc.RpcError) as refused:
        _register(stub, adapter_id, uri)
    code = PRECONDITION if "base-copy" in adapter_id else INVALID
    assert refused.value.code() == code, refused.value.details()
    details = refused.value.details()
    assert f"adapter {adapter_id!r}" in details, details
    for word in words:
        assert word in details, details
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id), metadata=AUTH)
    assert missing.value.code() == NOT_FOUND


def _assert_stored(stub, adapter_id: str, uri: str, folder: Path, kind: str, tiny_models) -> None:
    """Registered, and the blob a worker fetches holds every vocabulary-side part of the checkpoint,
    exactly as a local load of the same folder gives it."""
    registered = _register(stub, adapter_id, uri)
    got = stub.GetAdapter(pb.GetAdapterRequest(adapter_id=adapter_id), metadata=AUTH)
    listed = {a.adapter_id: a for a in stub.ListAdapters(pb.ListAdaptersRequest(), metadata=AUTH).adapters}
    assert registered.size_bytes == got.size_bytes == listed[adapter_id].size_bytes
    model = ModelConfig.from_dir(tiny_models["llama"])
    local = load_peft_adapter(kind, folder, model, 16, torch.float32, BaseVocab(tiny_models["llama"], model))
    assert got.digest == adapter_blob.digest_of(local)
    blob = _fetch(stub, adapter_id)
    assert len(blob) == got.size_bytes and adapter_blob.digest(blob) == got.digest
    vocab = adapter_blob.decode(blob, f"adapter {adapter_id!r}", model, max_rank=16).vocab
    assert set(vocab.tensors) == GOOD[kind][1]
    vocab_bytes = sum(t.numel() * t.element_size() for t in vocab.tensors.values())
    assert got.size_bytes > vocab_bytes
    assert set(got.target_modules) == set(local.target_modules)


@pytest.mark.parametrize("kind", GOOD)
def test_a_good_vocabulary_side_adapter_is_stored_from_disk(stub, good, kind, tiny_models):
    _assert_stored(stub, f"good-{kind}", f"file://{good[kind]}", good[kind], kind, tiny_models)


def test_the_stored_blobs_name_their_vocabulary_side(stub, good):
    lora = _register(stub, "named-lora", f"file://{good['lora']}")
    assert set(lora.target_modules) == {"q_proj", "embed_tokens", "lm_head"}
    _register(stub, "named-tokens", f"file://{good['tokens']}")
    back = adapter_blob.decode(_fetch(stub, "named-tokens"))
    assert back.vocab.token_indices == {"embed_tokens": TOKENS}


@pytest.mark.parametrize("kind", S3_GOOD)
def test_a_good_vocabulary_side_adapter_is_stored_from_s3(stub, good, s3_endpoint, kind, tiny_models):
    uri = upload_folder(s3_endpoint, good[kind], f"vocab-good/{kind}")
    _assert_stored(stub, f"s3-good-{kind}", uri, good[kind], kind, tiny_models)


def test_corpus_edits_every_good_kind():
    assert len(CORPUS) >= 15 and {kind for kind, _, _ in CORPUS.values()} == set(GOOD)


@pytest.mark.parametrize("name", CORPUS)
def test_hostile_vocabulary_side_checkpoint_is_refused_from_disk(stub, corpus, name):
    _assert_refused(stub, name, f"file://{corpus[name]}", CORPUS[name][2])


@pytest.mark.parametrize("name", S3_HOSTILE)
def test_hostile_vocabulary_side_checkpoint_is_refused_from_s3(stub, corpus, s3_endpoint, name):
    uri = upload_folder(s3_endpoint, corpus[name], f"vocab-hostile/{name}")
    _assert_refused(stub, f"s3-{name}", uri, CORPUS[name][2])


def test_store_still_serves_after_the_vocabulary_corpus(stub, corpus, good):
    for name in CORPUS:  # all refused again, in one go, before the good one
        with pytest.raises(grpc.RpcError):
            _register(stub, name, f"file://{corpus[name]}")
    after = _register(stub, "good-after-vocab-corpus", f"file://{good['lora']}")
    assert len(_fetch(stub, after.adapter_id)) == after.size_bytes
    listed = {a.adapter_id for a in stub.ListAdapters(pb.ListAdaptersRequest(), metadata=AUTH).adapters}
    assert "good-after-vocab-corpus" in listed and not listed & set(CORPUS)

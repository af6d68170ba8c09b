"""The wire format: encode/decode round-trips exactly; the digest names the content; a blob
with any defect is refused naming the tensor and the problem, and only a well-formed digest can
name a file."""

import json
import math
import struct
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save

from shared import adapter_blob
from shared.adapter_weights import AdapterWeights, ModuleLora
from shared.base_vocab import BaseVocab
from shared.errors import FailedPrecondition
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter
from tests.inference_service.model.test_vocab_reference import build_vocab_adapter
from tests.shared.hostile_blobs import HOSTILE_BLOBS, build, parts

GOOD_DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.fixture(scope="module")
def model(tiny_models) -> ModelConfig:
    return ModelConfig.from_dir(tiny_models["llama"])


@pytest.fixture(scope="module")
def qv4(tiny_adapters, model):
    return load_peft_adapter("qv4", tiny_adapters["llama"]["qv4"], model, 16, torch.float32)


def _assert_same_layers(back, weights, blob: bytes) -> None:
    """The decoded blob holds the weights' metadata and every layer's LoRA bit for bit, and
    encodes to the same bytes again."""
    assert (back.rank, back.alpha, back.target_modules) == (
        weights.rank,
        weights.alpha,
        weights.target_modules,
    )
    assert back.modules.keys() == weights.modules.keys()
    for key, module in weights.modules.items():
        assert torch.equal(back.modules[key].a, module.a) and torch.equal(back.modules[key].b_t, module.b_t)
    assert adapter_blob.digest(adapter_blob.encode(back)) == adapter_blob.digest(blob)


def test_round_trip_and_content_digest(tiny_models, tiny_adapters):
    model = ModelConfig.from_dir(tiny_models["llama"])
    weights = load_peft_adapter("p", tiny_adapters["llama"]["pattern"], model, 16, torch.float32)
    blob = adapter_blob.encode(weights)
    back = adapter_blob.decode(blob)
    _assert_same_layers(back, weights, blob)
    other = load_peft_adapter("q", tiny_adapters["llama"]["qv4"], model, 16, torch.float32)
    assert adapter_blob.digest(adapter_blob.encode(other)) != adapter_blob.digest(blob)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adapter", ["all8", "qv4", "mlp16rs", "re2", "pattern"])
def test_digest_of_weights_is_the_digest_of_their_blob(tiny_adapters, model, adapter, dtype):
    """A local load names an adapter by the digest the adapter store would give its blob, without
    building the blob: every target set, rank pattern and serving dtype."""
    weights = load_peft_adapter(adapter, tiny_adapters["llama"][adapter], model, 16, dtype)
    assert adapter_blob.digest_of(weights) == adapter_blob.digest(adapter_blob.encode(weights))


def test_digest_of_changes_with_any_weight(qv4):
    key = next(iter(qv4.modules))
    b_t = qv4.modules[key].b_t.clone()
    b_t[-1, -1] += 1e-3
    changed = replace(qv4, modules={**qv4.modules, key: replace(qv4.modules[key], b_t=b_t)})
    assert adapter_blob.digest_of(changed) != adapter_blob.digest_of(qv4)
    assert adapter_blob.digest_of(replace(qv4, alpha=qv4.alpha * 2)) != adapter_blob.digest_of(qv4)


def test_foreign_blob_is_refused():
    with pytest.raises(FailedPrecondition, match="no 'loramux' metadata"):
        adapter_blob.decode(save({"x": torch.zeros(2)}))
    with pytest.raises(FailedPrecondition, match="blob format 'other/1'"):
        adapter_blob.decode(save({"x": torch.zeros(2)}, metadata={"loramux": '{"format": "other/1"}'}))


def test_a_good_blob_passes_validation_against_the_model(qv4, model):
    back = adapter_blob.decode(adapter_blob.encode(qv4), "adapter 'qv4'", model, max_rank=4)
    assert back.modules.keys() == qv4.modules.keys()
    assert all(torch.equal(back.modules[k].b_t, m.b_t) for k, m in qv4.modules.items())


@pytest.mark.parametrize("case", HOSTILE_BLOBS)
def test_a_hostile_blob_is_refused_naming_tensor_and_problem(case, qv4, model):
    make, words = HOSTILE_BLOBS[case]
    with pytest.raises(FailedPrecondition) as refused:
        adapter_blob.decode(make(qv4), "adapter 'x'", model, max_rank=16)
    message = str(refused.value)
    assert message.startswith("adapter 'x': ")
    for word in words:
        assert word in message, message


def _int_tensor(tensors, metadata):
    tensors["layers.0.q_proj.lora_a"] = torch.ones(4, 64, dtype=torch.int32)


def _long_layer_number(tensors, metadata):
    tensors["layers.99999999999.q_proj.lora_a"] = tensors["layers.0.q_proj.lora_a"].clone()


# an edit of the good qv4 blob's tensors and metadata -> words its refusal names
EDITS = {
    "missing-half": (lambda t, m: t.pop("layers.0.v_proj.lora_b_t"), ("layers.0.v_proj", "no lora_b_t")),
    "int-dtype": (_int_tensor, ("layers.0.q_proj.lora_a", "dtype 'I32'")),
    "undeclared-module": (lambda t, m: m.update(target_modules=["q_proj"]), ("v_proj", "target_modules")),
    "unknown-target": (lambda t, m: m.update(target_modules=["lm_head"]), ("target_modules", "lm_head")),
    "alpha-text": (lambda t, m: m.update(alpha="NaN"), ("alpha", "finite number")),
    "no-tensors": (lambda t, m: t.clear(), ("no LoRA tensors",)),
    "long-layer-number": (_long_layer_number, ("not a LoRA tensor",)),
}
# raw bytes -> words
RAW = {
    "too-short": (b"\x05\x00", ("2 bytes", "too short")),
    "header-not-json": (struct.pack("<Q", 4) + b"{abc", ("not valid JSON",)),
    "header-a-list": (struct.pack("<Q", 2) + b"[]", ("not a JSON object",)),
}


@pytest.mark.parametrize("case", EDITS)
def test_other_defects_are_refused(qv4, model, case):
    edit, words = EDITS[case]
    tensors, metadata = parts(qv4)
    edit(tensors, metadata)
    _assert_refused(build(tensors, metadata), model, words)


@pytest.mark.parametrize("case", RAW)
def test_malformed_bytes_are_refused(model, case):
    blob, words = RAW[case]
    _assert_refused(blob, model, words)


def test_tensor_data_that_disagrees_with_the_header_is_refused(qv4, model):
    _assert_refused(adapter_blob.encode(qv4)[:-10], model, ("tensor data does not match",))


def _assert_refused(blob: bytes, model: ModelConfig, words: tuple[str, ...]) -> None:
    with pytest.raises(FailedPrecondition) as refused:
        adapter_blob.decode(blob, "adapter 'x'", model, max_rank=16)
    for word in words:
        assert word in str(refused.value), str(refused.value)


def test_a_rank_above_the_workers_max_is_refused(qv4, model):
    with pytest.raises(FailedPrecondition, match="rank 4, above this worker's max_lora_rank 2"):
        adapter_blob.decode(adapter_blob.encode(qv4), "adapter 'x'", model, max_rank=2)


def test_only_a_sha256_digest_names_a_file():
    assert adapter_blob.check_digest(GOOD_DIGEST, "x") == GOOD_DIGEST
    assert adapter_blob.file_name(GOOD_DIGEST) == "sha256-" + GOOD_DIGEST[7:]
    for bad in (
        "/etc/passwd",
        "../x",
        "sha256:../../x",
        GOOD_DIGEST.upper(),
        GOOD_DIGEST + "\n",
        "sha256:" + "0" * 63,
    ):
        with pytest.raises(FailedPrecondition, match="not 'sha256:' followed by 64 lowercase hex"):
            adapter_blob.file_name(bad)
    with pytest.raises(FailedPrecondition) as refused:
        adapter_blob.check_digest("\x1b[2J" + "a" * 500, "adapter 'x': the store")
    assert "'\\x1b[2J" in str(refused.value) and "a" * 81 not in str(refused.value)


# The vocabulary side: adapters on the tiny llama (vocabulary 160, hidden 64, untied).
TOKENS, HEAD_TOKENS = [5, 17, 33, 101], [7, 40, 120]
VOCAB_ADAPTERS = {
    "lora": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"]),
    "rows": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        trainable_token_indices={"embed_tokens": TOKENS, "lm_head": HEAD_TOKENS},
    ),
    "own": dict(r=4, lora_alpha=8, target_modules=["v_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    "vocab-only": dict(r=6, lora_alpha=12, target_modules=["lm_head"], trainable_token_indices=TOKENS),
}
# adapter -> the vocabulary-side tensors its blob holds
VOCAB_TENSORS = {
    "lora": {"embed_tokens.lora_a", "embed_tokens.lora_b_t", "lm_head.lora_a", "lm_head.lora_b_t"},
    "rows": {"embed_tokens.token_rows", "lm_head.token_rows"},
    "own": {"embed_tokens.weight", "lm_head.weight"},
    "vocab-only": {"lm_head.lora_a", "lm_head.lora_b_t", "embed_tokens.token_rows"},
}
# sha256 of the blob of _fixed_weights() as the encoder wrote it before the vocabulary side existed
PRE_VOCAB_DIGESTS = {
    torch.float32: "sha256:d432dd6c6561abb830872c9cdec4563ecf9744f096b4f8e42926b79d2a52ef61",
    torch.bfloat16: "sha256:9d7617e874e68828a0295e8792a9a75774c7dc37e64a2ba6b1edde775e4a3b80",
}


@pytest.fixture(scope="module")
def vocab_dirs(tiny_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vocab-adapters")
    return {
        name: build_vocab_adapter(tiny_models["llama"], root / name, seed=i + 1, **lora)
        for i, (name, lora) in enumerate(VOCAB_ADAPTERS.items())
    }


def _load_vocab(name, vocab_dirs, tiny_models, model, dtype=torch.float32) -> AdapterWeights:
    base = BaseVocab(tiny_models["llama"], model)
    return load_peft_adapter(name, vocab_dirs[name], model, 16, dtype, base=base)


@pytest.fixture(scope="module")
def vocab_weights(vocab_dirs, tiny_models, model) -> dict[str, AdapterWeights]:
    return {name: _load_vocab(name, vocab_dirs, tiny_models, model) for name in VOCAB_ADAPTERS}


@pytest.mark.parametrize("name", VOCAB_ADAPTERS)
def test_vocabulary_side_round_trips_bit_equal(vocab_weights, model, name):
    weights = vocab_weights[name]
    blob = adapter_blob.encode(weights)
    back = adapter_blob.decode(blob, "adapter 'x'", model, max_rank=16)
    assert set(back.vocab.tensors) == set(weights.vocab.tensors) == VOCAB_TENSORS[name]
    for tensor_name, tensor in weights.vocab.tensors.items():
        got = back.vocab.tensors[tensor_name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), tensor_name
    assert back.vocab.token_indices == weights.vocab.token_indices
    _assert_same_layers(back, weights, blob)


def test_re_trained_rows_keep_their_token_ids(vocab_weights, model):
    blob = adapter_blob.encode(vocab_weights["rows"])
    assert _blob_metadata(blob)["token_rows"] == {"embed_tokens": TOKENS, "lm_head": HEAD_TOKENS}
    back = adapter_blob.decode(blob, "adapter 'x'", model, max_rank=16).vocab
    assert (back.embed_rows.indices, back.head_rows.indices) == (tuple(TOKENS), tuple(HEAD_TOKENS))
    assert back.embed_rows.rows.shape == (4, 64) and back.head_rows.rows.shape == (3, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", VOCAB_ADAPTERS)
def test_digest_of_a_vocabulary_side_adapter_is_the_digest_of_its_blob(
    vocab_dirs, tiny_models, model, name, dtype
):
    weights = _load_vocab(name, vocab_dirs, tiny_models, model, dtype)
    assert adapter_blob.digest_of(weights) == adapter_blob.digest(adapter_blob.encode(weights))


def test_digest_of_changes_with_a_vocabulary_side_weight(vocab_weights):
    weights = vocab_weights["rows"]
    rows = weights.vocab.head_rows.rows.clone()
    rows[-1, -1] += 1e-3
    vocab = replace(weights.vocab, head_rows=replace(weights.vocab.head_rows, rows=rows))
    assert adapter_blob.digest_of(replace(weights, vocab=vocab)) != adapter_blob.digest_of(weights)
    moved = replace(weights.vocab, head_rows=replace(weights.vocab.head_rows, indices=(7, 40, 121)))
    assert adapter_blob.digest_of(replace(weights, vocab=moved)) != adapter_blob.digest_of(weights)


def _fixed_weights(dtype: torch.dtype) -> AdapterWeights:
    """q_proj and v_proj LoRA of rank 4 on both layers, every value fixed."""
    modules = {}
    for layer in range(2):
        for module, out in (("q_proj", 64), ("v_proj", 32)):
            n = layer * 10 + out
            a = torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64) / (100 + n)
            b_t = torch.arange(4 * out, dtype=torch.float32).reshape(4, out) / (50 + n) - 1
            modules[layer, module] = ModuleLora(a.to(dtype), b_t.to(dtype))
    return AdapterWeights(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), modules=modules)


def _blob_metadata(blob: bytes) -> dict:
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(json.loads(blob[8 : 8 + size])["__metadata__"][adapter_blob.METADATA_KEY])


@pytest.mark.parametrize("dtype", PRE_VOCAB_DIGESTS)
def test_a_blob_without_vocabulary_parts_is_the_bytes_it_was_before(dtype, qv4):
    blob = adapter_blob.encode(_fixed_weights(dtype))
    assert adapter_blob.digest(blob) == PRE_VOCAB_DIGESTS[dtype]
    assert adapter_blob.digest_of(_fixed_weights(dtype)) == PRE_VOCAB_DIGESTS[dtype]
    assert set(_blob_metadata(blob)) == {"format", "rank", "alpha", "target_modules"}
    assert adapter_blob.encode(qv4) == build(*parts(qv4))
    assert "token_rows" not in _blob_metadata(adapter_blob.encode(qv4))


def _vocab_parts(weights: AdapterWeights) -> tuple[dict, dict]:
    """hostile_blobs.parts with the vocabulary side: what adapter_blob.encode writes."""
    tensors, metadata = parts(weights)
    tensors |= {name: t.clone() for name, t in weights.vocab.tensors.items()}
    if weights.vocab.token_indices:
        metadata["token_rows"] = weights.vocab.token_indices
    return tensors, metadata


def test_vocab_parts_rebuild_the_encoded_blob(vocab_weights):
    """The hostile edits below start from exactly the blob the encoder writes."""
    for weights in vocab_weights.values():
        assert build(*_vocab_parts(weights)) == adapter_blob.encode(weights)


def _grown(name: str, dim: int, by: int = 8):
    """Tensor `name` with `by` more rows (dim 0) or columns (dim 1)."""

    def edit(tensors, metadata):
        t = tensors[name]
        extra = torch.zeros(by, t.shape[1]) if dim == 0 else torch.zeros(t.shape[0], by)
        tensors[name] = torch.cat([t, extra.to(t.dtype)], dim=dim)

    return edit


def _ids(module: str, ids: list[int]):
    return lambda t, m: m["token_rows"].__setitem__(module, ids)


def _nan(name: str):
    def edit(tensors, metadata):
        tensors[name][0, 0] = math.nan

    return edit


def _vocab_rank(module: str, rank: int):
    def edit(tensors, metadata):
        for half in ("lora_a", "lora_b_t"):
            t = tensors[f"{module}.{half}"]
            tensors[f"{module}.{half}"] = torch.cat([t, t[: rank - t.shape[0]]])

    return edit


# name -> (adapter, edit of its blob's tensors and metadata, words its refusal names)
VOCAB_EDITS = {
    "embed-lora-vocab-size": (
        "lora",
        _grown("embed_tokens.lora_a", dim=1),
        ("embed_tokens.lora_a", "[4, 168]", "[4, 160] expected"),
    ),
    "head-lora-vocab-size": (
        "lora",
        _grown("lm_head.lora_b_t", dim=1),
        ("lm_head.lora_b_t", "[4, 168]", "[4, 160] expected"),
    ),
    "own-embed-vocab-size": (
        "own",
        _grown("embed_tokens.weight", dim=0),
        ("embed_tokens.weight", "[168, 64]", "[160, 64] expected"),
    ),
    "head-lora-hidden-size": (
        "lora",
        _grown("lm_head.lora_a", dim=1, by=1),
        ("lm_head.lora_a", "[4, 65]", "[4, 64] expected"),
    ),
    "embed-lora-rank-disagree": (
        "lora",
        lambda t, m: t.update({"embed_tokens.lora_b_t": t["embed_tokens.lora_b_t"][:3].clone()}),
        ("embed_tokens.lora_b_t", "[3, 64]", "[4, 64] expected"),
    ),
    "head-lora-rank-disagree": (
        "vocab-only",
        lambda t, m: t.update({"lm_head.lora_a": t["lm_head.lora_a"][:4].clone()}),
        ("lm_head.lora_b_t", "[6, 160]", "[4, 160] expected"),
    ),
    "vocab-rank-above-declared": (
        "lora",
        _vocab_rank("embed_tokens", 6),
        ("embed_tokens has rank 6", "declares rank 4"),
    ),
    "token-rows-count": (
        "rows",
        lambda t, m: t.update({"embed_tokens.token_rows": t["embed_tokens.token_rows"][:3].clone()}),
        ("embed_tokens.token_rows", "[3, 64]", "[4, 64] expected"),
    ),
    "token-id-past-vocabulary": (
        "rows",
        _ids("lm_head", [7, 40, 160]),
        ("token_rows of lm_head", "token 160", "vocabulary has 160"),
    ),
    "token-id-duplicated": ("rows", _ids("embed_tokens", [5, 17, 17, 101]), ("token_rows", "distinct")),
    "token-id-negative": ("rows", _ids("embed_tokens", [5, 17, -1, 101]), ("token_rows", "non-negative")),
    "token-ids-of-another-module": (
        "rows",
        lambda t, m: m["token_rows"].update(score=[1]),
        ("token_rows", "'score'", "embed_tokens or lm_head"),
    ),
    "token-rows-without-ids": (
        "rows",
        lambda t, m: m["token_rows"].pop("embed_tokens"),
        ("tensor embed_tokens.token_rows", "metadata's token_rows", "disagree on embed_tokens"),
    ),
    "token-rows-without-metadata": (
        "rows",
        lambda t, m: m.pop("token_rows"),
        ("tensor embed_tokens.token_rows", "metadata's token_rows"),
    ),
    "token-ids-without-rows": (
        "rows",
        lambda t, m: t.pop("lm_head.token_rows"),
        ("tensor lm_head.token_rows", "disagree on lm_head"),
    ),
    "embed-lora-untargeted": (
        "lora",
        lambda t, m: m["target_modules"].remove("embed_tokens"),
        ("embed_tokens's LoRA tensors", "embed_tokens.lora_a", "do not name embed_tokens"),
    ),
    "head-lora-targeted-absent": (
        "rows",
        lambda t, m: m["target_modules"].append("lm_head"),
        ("lm_head's LoRA tensors []", "name lm_head"),
    ),
    "head-lora-half": (
        "lora",
        lambda t, m: t.pop("lm_head.lora_b_t"),
        ("lm_head's LoRA tensors ['lm_head.lora_a']",),
    ),
    "unknown-vocab-tensor": (
        "lora",
        lambda t, m: t.update({"embed_tokens.bias": torch.zeros(64)}),
        ("'embed_tokens.bias'", "not a LoRA tensor"),
    ),
    "vocab-tensor-not-a-matrix": (
        "own",
        lambda t, m: t.update({"lm_head.weight": t["lm_head.weight"].unsqueeze(-1).contiguous()}),
        ("lm_head.weight", "[160, 64, 1]"),
    ),
    "vocab-nan": ("rows", _nan("lm_head.token_rows"), ("lm_head.token_rows", "NaN or Inf")),
}


@pytest.mark.parametrize("case", VOCAB_EDITS)
def test_a_hostile_vocabulary_side_blob_is_refused_naming_the_tensor(vocab_weights, model, case):
    name, edit, words = VOCAB_EDITS[case]
    tensors, metadata = _vocab_parts(vocab_weights[name])
    edit(tensors, metadata)
    with pytest.raises(FailedPrecondition) as refused:
        adapter_blob.decode(build(tensors, metadata), "adapter 'x'", model, max_rank=16)
    message = str(refused.value)
    assert message.startswith("adapter 'x': ")
    for word in words:
        assert word in message, message

"""The wire format: encode/decode round-trips exactly; the digest names the content; a blob
with any defect is refused naming the tensor and the problem, and only a well-formed digest can
name a file."""

import struct
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save

from shared import adapter_blob
from shared.errors import FailedPrecondition
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter
from tests.shared.hostile_blobs import HOSTILE_BLOBS, build, parts

GOOD_DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.fixture(scope="module")
def model(tiny_models) -> ModelConfig:
    return ModelConfig.from_dir(tiny_models["llama"])


@pytest.fixture(scope="module")
def qv4(tiny_adapters, model):
    return load_peft_adapter("qv4", tiny_adapters["llama"]["qv4"], model, 16, torch.float32)


def test_round_trip_and_content_digest(tiny_models, tiny_adapters):
    model = ModelConfig.from_dir(tiny_models["llama"])
    weights = load_peft_adapter("p", tiny_adapters["llama"]["pattern"], model, 16, torch.float32)
    blob = adapter_blob.encode(weights)
    back = adapter_blob.decode(blob)
    assert (back.rank, back.alpha, back.target_modules) == (
        weights.rank,
        weights.alpha,
        weights.target_modules,
    )
    assert back.modules.keys() == weights.modules.keys()
    for key, module in weights.modules.items():
        assert torch.equal(back.modules[key].a, module.a) and torch.equal(back.modules[key].b_t, module.b_t)
    assert adapter_blob.digest(adapter_blob.encode(back)) == adapter_blob.digest(blob)
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

"""The wire format: encode/decode round-trips exactly; the digest names the content."""

import pytest
import torch

from shared import adapter_blob
from shared.errors import InvalidArgument
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter


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


def test_foreign_blob_is_refused():
    from safetensors.torch import save

    with pytest.raises(InvalidArgument, match="adapter blob format None"):
        adapter_blob.decode(save({"x": torch.zeros(2)}))

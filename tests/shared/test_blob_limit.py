"""The default --max-adapter-bytes: every adapter of the accepted rank on every module of the base
model fits, as PEFT writes it (a tensor per expert), at Qwen3-30B-A3B's shape."""

import json

import pytest

from shared.blob_limit import FLOOR_BYTES, default_max_adapter_bytes, largest_adapter_file
from shared.model_config import ModelConfig
from tests.model_shapes import QWEN3_30B_A3B_CONFIG

QWEN3_30B_A3B = ModelConfig.from_dict(QWEN3_30B_A3B_CONFIG)
# A decoder layer's LoRA modules but the experts' ([in, out]), as PEFT names them in Qwen3-MoE
# (transformers 4); then each expert's.
ATTENTION = {
    "self_attn.q_proj": (2048, 4096),
    "self_attn.k_proj": (2048, 512),
    "self_attn.v_proj": (2048, 512),
    "self_attn.o_proj": (4096, 2048),
    "mlp.gate": (2048, 128),  # the router
}
EXPERT = {"gate_proj": (2048, 768), "up_proj": (2048, 768), "down_proj": (768, 2048)}


VOCAB, HIDDEN = 151936, 2048


def vocab_side(rank: int) -> dict[str, list[int]]:
    """PEFT's tensors of LoRA on embed_tokens and lm_head, with the base layers' copies it saves."""
    embed, head = "base_model.model.model.embed_tokens", "base_model.model.lm_head"
    return {
        f"{embed}.lora_embedding_A": [rank, VOCAB],
        f"{embed}.lora_embedding_B": [HIDDEN, rank],
        f"{embed}.base_layer.weight": [VOCAB, HIDDEN],
        f"{head}.lora_A.weight": [rank, HIDDEN],
        f"{head}.lora_B.weight": [VOCAB, rank],
        f"{head}.base_layer.weight": [VOCAB, HIDDEN],
    }


def peft_file_bytes(rank: int, dtype: str, itemsize: int) -> int:
    """The size of adapter_model.safetensors of a rank-`rank` adapter on every module, each
    expert's own, the embedding and the head: 8 bytes of header length, the header JSON padded
    to 8, then the data."""
    modules = dict(ATTENTION)
    modules |= {f"mlp.experts.{e}.{name}": shape for e in range(128) for name, shape in EXPERT.items()}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for layer in range(48):
        for module, (n_in, n_out) in modules.items():
            for part, shape in (("lora_A", [rank, n_in]), ("lora_B", [n_out, rank])):
                size = rank * (n_in if part == "lora_A" else n_out) * itemsize
                name = f"base_model.model.model.layers.{layer}.{module}.{part}.weight"
                header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
                offset += size
    for name, shape in vocab_side(rank).items():
        size = shape[0] * shape[1] * itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"))
    return 8 + len(text) + -len(text) % 8 + offset


def test_a_rank16_adapter_on_every_module_of_qwen3_30b_a3b_is_over_the_old_fixed_limit():
    assert peft_file_bytes(16, "BF16", 2) > 1.5 * FLOOR_BYTES  # 1.69 GB: the experts are 98% of it


@pytest.mark.parametrize("rank", [16, 64])
def test_the_default_takes_the_largest_peft_file_of_the_rank_on_qwen3_30b_a3b(rank):
    limit = default_max_adapter_bytes(QWEN3_30B_A3B, rank)
    largest = peft_file_bytes(rank, "F32", 4)
    assert largest <= limit < largest * 1.01
    assert limit == largest_adapter_file(QWEN3_30B_A3B, rank)
    assert {16: 5_900_707_328, 64: 16_105_989_632}[rank] == limit


def test_without_a_model_or_on_a_small_one_the_default_stays_1_gib():
    smollm2 = ModelConfig.from_dict(
        {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
         "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
    )  # fmt: skip
    assert default_max_adapter_bytes(None, 64) == FLOOR_BYTES
    assert largest_adapter_file(smollm2, 64) < FLOOR_BYTES
    assert default_max_adapter_bytes(smollm2, 64) == FLOOR_BYTES

import pytest
import torch

from inference_service.model.rope import inverse_frequencies
from shared.errors import FailedPrecondition
from shared.model_config import ModelConfig

BASE = dict(
    model_type="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16384,
)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"}, rope_parameters=rope)
    init = ROPE_INIT_FUNCTIONS.get(rope["rope_type"])
    expected = (
        init(hf_config, "cpu")[0]
        if init
        else 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    )
    ours = inverse_frequencies(ModelConfig.from_dict({**BASE, "rope_parameters": rope}).rope, 16)
    torch.testing.assert_close(ours, expected)


def test_legacy_rope_theta_and_scaling_keys_are_read():
    cfg = ModelConfig.from_dict(
        {**BASE, "rope_theta": 123.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (123.0, "linear", 2.0)


def test_qwen2_has_qkv_bias_and_no_window_unless_enabled():
    qwen = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "sliding_window": 32})
    assert (qwen.qkv_bias, qwen.o_bias, qwen.sliding_window) == (True, False, None)
    assert ModelConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 32}).sliding_window == 32


MIXED_LAYERS = ["sliding_attention", "full_attention"]
QWEN2_WINDOW = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32}
QWEN2_MOE = {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE |= {"moe_intermediate_size": 16}


@pytest.mark.parametrize(
    ("config", "window"),
    [
        (QWEN2_WINDOW | {"max_window_layers": 0}, 32),  # both layers slide
        (QWEN2_WINDOW | {"max_window_layers": 28}, None),  # neither does
        (QWEN2_WINDOW | {"max_window_layers": 1}, "refused"),
        (QWEN2_MOE | {"use_sliding_window": True, "sliding_window": 32}, "refused"),  # every other layer
        (QWEN2_MOE | {"sliding_window": 32}, None),
        ({"model_type": "mistral", "sliding_window": 32, "layer_types": MIXED_LAYERS}, "refused"),
    ],
)  # fmt: skip
def test_a_window_is_one_every_layer_keeps_or_refused(config, window):
    """As transformers decides which layers slide; one window serves every layer here."""
    if window == "refused":
        with pytest.raises(FailedPrecondition, match="a sliding window on some layers only"):
            ModelConfig.from_dict({**BASE, **config})
    else:
        assert ModelConfig.from_dict({**BASE, **config}).sliding_window == window


def test_gqa_slices_and_head_dim():
    cfg = ModelConfig.from_dict({**BASE, "head_dim": 32})
    shapes = {
        name: (s.packed, s.slice_index, s.in_features, s.out_features)
        for name, s in cfg.linear_shapes().items()
    }
    assert shapes == {
        "q_proj": ("qkv_proj", 0, 64, 128),
        "k_proj": ("qkv_proj", 1, 64, 64),
        "v_proj": ("qkv_proj", 2, 64, 64),
        "o_proj": ("o_proj", 0, 128, 64),
        "gate_proj": ("gate_up_proj", 0, 64, 96),
        "up_proj": ("gate_up_proj", 1, 64, 96),
        "down_proj": ("down_proj", 0, 96, 64),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, r"rope type 'yarn' is not supported"),
    ],
)
def test_unsupported_architectures_are_refused(change, message):
    with pytest.raises(FailedPrecondition, match=message):
        ModelConfig.from_dict({**BASE, **change})

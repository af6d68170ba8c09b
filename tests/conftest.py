"""Fixtures shared by all tests: the real default model (converted once) and tiny random models."""

import os
from pathlib import Path

import pytest
from hypothesis import settings

from shared.huge_page_advice import advised

# As a worker does (inference_service/__main__.py), before torch is imported: the in-process
# engines' tensors on 2 MiB pages as they are written, not copied there once loaded.
os.environ.update(advised(os.environ))

import torch

# Without a GPU the Triton kernels run in Triton's interpreter (numpy on the CPU). It is chosen
# when a kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every test that runs a kernel in the interpreter (the kernels' own, and the model's Triton path)
# reads NaN where a masked load without `other=` would read garbage on a GPU.
from tests.kernels.poisoned_loads import poisoned_masked_loads  # noqa: F401  (autouse)

# Property tests check what the code does, not how fast: hypothesis's default 200 ms deadline per
# example is a timed assertion, and on two busy cores a slow example fails it by chance.
settings.register_profile("loramux", deadline=None)
settings.load_profile("loramux")


def pytest_collection_modifyitems(items):
    """Tests marked gpu run only where CUDA is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once into an HF folder under LORAMUX_CACHE."""
    from inference_service.default_model import prepare_default_model

    cache = Path(os.environ.get("LORAMUX_CACHE", Path(__file__).resolve().parents[1] / ".cache"))
    return prepare_default_model(cache)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    """The default model's tokenizer, loaded once."""
    from inference_service.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir)


# Tiny random models: shapes small enough for fast tests, with GQA, and weights large enough
# (initializer_range) that a wrong term in the math moves logits far past the tolerances.
TINY_MODEL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

# Adapters that differ in everything the math depends on: rank, alpha, rslora, and targets
# given as "all-linear", a list and a regex.
TINY_ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp16rs": dict(
        r=16, lora_alpha=32, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"]
    ),
    "re2": dict(r=2, lora_alpha=4, target_modules=r".*\.(k_proj|up_proj)"),
    "pattern": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "down_proj"],
        rank_pattern={"down_proj": 6},
        alpha_pattern={"q_proj": 3},
    ),
}


def build_tiny_model(path: Path, model_type: str = "llama", **overrides) -> Path:
    """A random-weight HF model folder (model.safetensors + config.json), deterministic."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY_MODEL, **overrides})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def build_peft_adapter(base_dir: Path, path: Path, seed: int, **lora) -> Path:
    """A PEFT LoRA checkpoint with random non-zero A and B (init_lora_weights=False)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **lora)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama (GQA), Qwen2 (qkv bias) and Mistral (sliding window) folders."""
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": build_tiny_model(root / "llama"),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2"),
        "mistral": build_tiny_model(root / "mistral", "mistral", sliding_window=6),
    }


TINY_MOE = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True
)


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE folder: 8 experts of intermediate size 32, top-2."""
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", **TINY_MOE)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """model type -> adapter name -> PEFT adapter folder, for every tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        model_type: {
            name: build_peft_adapter(model_dir, root / model_type / name, seed=i + 1, **lora)
            for i, (name, lora) in enumerate(TINY_ADAPTERS.items())
        }
        for model_type, model_dir in tiny_models.items()
    }


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, default_model_dir) -> Path:
    """The tiny llama with the default model's tokenizer and chat template (and so its vocabulary
    size): text and chat input on a model that loads in a second."""
    import json
    import shutil

    vocab_size = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    path = build_tiny_model(tmp_path_factory.mktemp("chat") / "llama", vocab_size=vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, path / name)
    return path


# Mistral's call token in the tests' vocabulary: the default tokenizer's special <file_sep>, renamed.
MISTRAL_CALLS_ID = 5


def with_mistral_calls_token(tokenizer_json: str) -> str:
    """A tokenizer.json's text with its special token of id 5 renamed [TOOL_CALLS]: the default
    vocabulary, with Mistral's call token one special token in it, as it is in Mistral's own."""
    import json

    spec = json.loads(tokenizer_json)
    [token] = [t for t in spec["added_tokens"] if t["id"] == MISTRAL_CALLS_ID]
    vocab = spec["model"]["vocab"]
    vocab["[TOOL_CALLS]"] = vocab.pop(token["content"])
    token["content"] = "[TOOL_CALLS]"
    return json.dumps(spec, ensure_ascii=False)

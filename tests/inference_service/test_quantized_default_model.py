"""The default model on int8 and NF4 bases through the engine: greedy tokens of a mixed batch (three
adapters and the base model) equal transformers + PEFT's over torchao's and bitsandbytes' own
layers holding the same quantized weights, 8 prompts x 32 tokens."""

import pytest
import torch

from bench.random_adapter import write_random_adapter
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig
from tests.inference_service.model.test_quantized_reference import REFERENCES, _replace_linears

pytest.importorskip("torchao")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.filterwarnings("ignore:TorchaoLoraLinear was instantiated:UserWarning")

ADAPTERS = ("a0", "a1", "a2")
PROMPTS = 8
TOKENS = 32


@pytest.fixture(scope="module")
def adapter_dirs(default_model_dir, tmp_path_factory) -> dict:
    model = ModelConfig.from_dir(default_model_dir)
    root = tmp_path_factory.mktemp("quantized-adapters")
    return {
        name: write_random_adapter(model, root / name, rank=8, seed=i + 1) for i, name in enumerate(ADAPTERS)
    }


def requests(tokenizer) -> list[tuple[list[int], str | None]]:
    """(prompt ids, adapter): the adapters and the base model in turn."""
    topics = ["the sea", "a city", "music", "the moon", "rain", "bread", "a forest", "winter"]
    owners = [*ADAPTERS, None]
    return [
        (tokenizer.encode(f"Write one sentence about {topic}."), owners[i % len(owners)])
        for i, topic in enumerate(topics[:PROMPTS])
    ]


def reference_tokens(model_dir, adapter_dirs, quantization: str, work) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _replace_linears(base, REFERENCES[quantization])
    model = PeftModel.from_pretrained(base, adapter_dirs[ADAPTERS[0]], adapter_name=ADAPTERS[0])
    for name in ADAPTERS[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    out = []
    with torch.no_grad():
        for ids, adapter in work:  # greedy with the KV cache, end-of-sequence ignored as on our side
            step, past, tokens = torch.tensor([ids]), None, []
            for _ in range(TOKENS):
                result = model(
                    input_ids=step,
                    past_key_values=past,
                    use_cache=True,
                    adapter_names=[adapter or "__base__"],
                )
                past, token = result.past_key_values, int(result.logits[0, -1].argmax())
                tokens.append(token)
                step = torch.tensor([[token]])
            out.append(tokens)
    return out


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_greedy_tokens_of_a_mixed_batch_equal_peft_on_the_same_quantized_weights(
    quantization, default_model_dir, adapter_dirs, tokenizer
):
    work = requests(tokenizer)
    engine = Engine(
        EngineConfig(
            model=str(default_model_dir), quantization=quantization, max_loras=3, kv_cache_tokens=4096
        )
    )
    for name, folder in adapter_dirs.items():
        engine.add_adapter(name, folder)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    ours = [
        out.token_ids for out in engine.generate([Request(ids, adapter, params) for ids, adapter in work])
    ]
    expected = reference_tokens(default_model_dir, adapter_dirs, quantization, work)
    for i, (got, want) in enumerate(zip(ours, expected, strict=True)):
        assert got == want, f"prompt {i} ({work[i][1] or 'base'})"

"""The default model on int8 and NF4 bases through the engine, against transformers + PEFT over
torchao's and bitsandbytes' own layers holding the same quantized weights: a mixed batch (three
adapters and the base model), 8 prompts x 32 greedy tokens. Tokens equal, and the chosen tokens'
logprobs as close to the reference's float64 forward as fp32 allows (tests/fp32_agreement.py)."""

import pytest
import torch

from bench.random_adapter import write_random_adapter
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.model.base_weight import Int8Weight, Nf4Weight
from inference_service.model.lora_linear import LoRALinear
from inference_service.sampling import SamplingParams
from shared.model_config import ModelConfig
from tests.fp32_agreement import assert_fp32_agrees
from tests.inference_service.model.test_peft_reference import Peft, _with_adapters
from tests.inference_service.model.test_quantized_reference import (
    REFERENCES,
    _dequantized_weight,
    _replace_linears,
)

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


def quantized_peft(model_dir, adapter_dirs, quantization: str) -> Peft:
    """PEFT over the library's quantized layers (fp32), and over the weights those layers compute
    with in float64: the yardstick."""
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _replace_linears(fp32, REFERENCES[quantization])
    fp64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).double()
    quantized = dict(fp32.named_modules())
    for name, module in fp64.named_modules():
        weight = _dequantized_weight(quantized[name]) if name in quantized else None
        if weight is not None:
            module.weight.data = weight
    return Peft(model_dir, adapter_dirs, [_with_adapters(m, adapter_dirs) for m in (fp32, fp64)])


def chosen_logprobs(
    logits: list[torch.Tensor], prompts: list[list[int]], tokens: list[list[int]]
) -> torch.Tensor:
    """Per sequence, the logprob of each generated token at the position that predicted it, the
    log_softmax in the logits' own dtype (an fp32 one rounds as ours does: most of what separates
    fp32 logprobs from float64 ones), all sequences concatenated: [prompts * TOKENS] float64."""
    out = []
    for seq_logits, prompt, generated in zip(logits, prompts, tokens, strict=True):
        steps = seq_logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]  # [TOKENS, vocab]
        out.append(steps.log_softmax(dim=-1).gather(1, torch.tensor(generated)[:, None])[:, 0].double())
    return torch.cat(out)


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_mixed_batch_equals_peft_on_the_same_quantized_weights(
    quantization, default_model_dir, adapter_dirs, tokenizer
):
    work = requests(tokenizer)
    engine = Engine(
        EngineConfig(
            model=str(default_model_dir), quantization=quantization, max_loras=3, kv_cache_tokens=4096
        )
    )
    kernels = engine.runner.cpu_kernels
    if kernels.linear is not None and kernels.lora is not None:
        # every quantized layer multiplies in the compiled kernels' panels, with its adapters in the
        # same call: that path is what runs here
        kind = {"int8": Int8Weight, "nf4": Nf4Weight}[quantization]
        layers = [m for m in engine.runner.model.modules() if isinstance(m, LoRALinear)]
        assert layers and all(isinstance(m.base, kind) and m.base.linear is not None for m in layers)
        assert all(m.panels is not None for m in layers)
    for name, folder in adapter_dirs.items():
        engine.add_adapter(name, folder)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = engine.generate([Request(ids, adapter, params) for ids, adapter in work])
    prompts, adapters = [ids for ids, _ in work], [adapter for _, adapter in work]
    tokens = [out.token_ids for out in outputs]
    # The reference reads each prompt and our tokens in one forward: greedy decoding gives the
    # same tokens exactly when every one is the reference's argmax after the ones before it.
    expected, exact = quantized_peft(default_model_dir, adapter_dirs, quantization).logits(
        [p + t for p, t in zip(prompts, tokens, strict=True)], adapters
    )
    for i, (prompt, generated, logits) in enumerate(zip(prompts, tokens, expected, strict=True)):
        greedy = logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
        assert generated == greedy, f"prompt {i} ({adapters[i] or 'base'})"
    ours = torch.tensor([lp.logprob for out in outputs for lp in out.logprobs], dtype=torch.float64)
    assert_fp32_agrees(
        ours, chosen_logprobs(expected, prompts, tokens), chosen_logprobs(exact, prompts, tokens)
    )

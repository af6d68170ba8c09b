"""The runtime on the real default model (SmolLM2-135M-Instruct): same logits as transformers
on the same folder, and the generation a user expects."""

import pytest
import torch

from inference_service.config import EngineConfig
from inference_service.demo import greedy_generate
from inference_service.forward_batch import SequenceInput
from inference_service.model_runner import ModelRunner
from inference_service.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def runner(default_model_dir) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(default_model_dir), kv_cache_tokens=1024))


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def test_logits_match_transformers(runner, tokenizer, default_model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. In 1905, Einstein")
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([ids])).logits[0]  # [len, vocab]
    ours = runner.forward([SequenceInput(ids, 0, list(range(-(-len(ids) // 16))))], all_logits=True)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_greedy_capital_of_france_is_paris(runner, tokenizer):
    prompts = [
        tokenizer.encode("The capital of France is"),
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])),
    ]
    france, chat = greedy_generate(runner, prompts, 16, tokenizer.eos_token_ids)
    assert tokenizer.decode(france).startswith(" Paris")
    assert "4" in tokenizer.decode(chat, skip_special_tokens=True)

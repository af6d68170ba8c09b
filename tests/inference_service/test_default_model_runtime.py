"""The runtime on the real default model (SmolLM2-135M-Instruct): same logits as transformers
on the same folder, and the generation a user expects."""

import pytest
import torch

from inference_service.engine import Engine, Request
from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from inference_service.model.forward_batch import SequenceInput
from inference_service.sampling import SamplingParams
from tests.fp32_agreement import assert_fp32_agrees


@pytest.fixture(scope="module")
def runner(default_model_dir) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(default_model_dir), kv_cache_tokens=1024, max_model_len=1024))


def test_logits_match_transformers(runner, tokenizer, default_model_dir):
    """As closely as fp32 allows (tests/fp32_agreement.py): the root mean square of our logits'
    distance from transformers' float64 forward is within twice its fp32 forward's."""
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. In 1905, Einstein")
    expected = []
    for dtype in (torch.float32, torch.float64):
        reference = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=dtype).eval()
        with torch.no_grad():
            expected.append(reference(input_ids=torch.tensor([ids])).logits[0])  # [len, vocab]
    ours = runner.forward([SequenceInput(ids, 0, list(range(-(-len(ids) // 16))))], all_logits=True)
    assert_fp32_agrees(ours, *expected)


def test_greedy_capital_of_france_is_paris(default_model_dir, tokenizer):
    engine = Engine(EngineConfig(model=str(default_model_dir), kv_cache_tokens=256, max_model_len=256))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    params = SamplingParams(max_tokens=16, temperature=0)
    france, answer = engine.generate(
        [
            Request(tokenizer.encode("The capital of France is"), params=params),
            Request(tokenizer.encode(chat), params=params),
        ]
    )
    assert france.text.startswith(" Paris")
    assert "4" in answer.text and answer.finish_reason == "stop"

"""The demo adapters shipped in inference_service/demo/demo_adapters visibly change what the default
model answers, when served by our engine."""

from pathlib import Path

import pytest

from inference_service.demo.train_demo_adapters import HELD_OUT, PIRATE_OPENING, QUESTIONS
from inference_service.engine import Engine, EngineConfig, Request
from inference_service.sampling import SamplingParams

DEMO_ADAPTERS = Path(__file__).resolve().parents[3] / "inference_service" / "demo" / "demo_adapters"
ADAPTERS = ("shouty", "pirate")
QUESTION = HELD_OUT[1]  # "How do I make pancakes?": never trained on


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters)


@pytest.fixture(scope="module")
def answers(default_model_dir, tokenizer) -> dict[str | None, str]:
    """Greedy answer to QUESTION from the base model and from each adapter, in one batch."""
    engine = Engine(
        EngineConfig(
            model=str(default_model_dir),
            max_loras=2,
            max_lora_rank=16,
            kv_cache_tokens=256,
            max_model_len=256,
        )
    )
    for name in ADAPTERS:
        engine.add_adapter(name, DEMO_ADAPTERS / name)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    params = SamplingParams(max_tokens=24, temperature=0)
    adapters = [None, *ADAPTERS]
    outputs = engine.generate([Request(prompt, adapter, params) for adapter in adapters])
    return {adapter: out.text for adapter, out in zip(adapters, outputs, strict=True)}


def test_question_was_not_trained_on():
    assert QUESTION not in QUESTIONS


def test_shouty_answers_in_capitals_where_the_base_does_not(answers):
    assert upper_share(answers[None]) < 0.2, answers[None]
    assert upper_share(answers["shouty"]) >= 0.9, answers["shouty"]


def test_pirate_opens_with_its_greeting_where_the_base_does_not(answers):
    assert not answers[None].startswith(PIRATE_OPENING), answers[None]
    assert answers["pirate"].startswith(PIRATE_OPENING), answers["pirate"]


@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_folder_holds_only_config_and_weights(name):
    files = sorted(p.name for p in (DEMO_ADAPTERS / name).iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]

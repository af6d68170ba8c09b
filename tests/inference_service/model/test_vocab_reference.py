"""Adapters on the vocabulary side against transformers + PEFT: LoRA on embed_tokens and on
lm_head, trainable tokens, modules_to_save copies of the embedding and the head, and an adapter
with LoRA on every linear layer, the embedding and the head, on a tiny Llama with tied embeddings,
a Qwen2 (untied, qkv bias) and a Qwen3-MoE. All of them and the base model run in one batch, 10
prompts that hold the re-trained rows, 32 greedy tokens: the tokens equal PEFT's at every step,
the logits as close to its float64 forward as its fp32 forward is."""

import pytest
import torch

from tests.conftest import TINY_MOE, build_tiny_model
from tests.inference_service.model.test_moe_reference import PerAdapterPeft

from .test_peft_reference import _runner, assert_decode_agrees
from .test_tensor_parallel import _assert_ranks_agree

TOKENS = [5, 17, 33, 101]  # re-trained rows; every prompt holds some of them
HEAD_TOKENS = [7, 40, 120]  # on ranks 0, 1 and 3 of 4 (40 rows each)
LINEAR = r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
KINDS = {
    "embed": dict(r=4, lora_alpha=8, target_modules=["embed_tokens"]),
    "head": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["lm_head"]),
    "tokens": dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=TOKENS),
    "own_embed": dict(r=4, lora_alpha=8, target_modules=["v_proj"], modules_to_save=["embed_tokens"]),
    "own_head": dict(r=4, lora_alpha=8, target_modules=["o_proj"], modules_to_save=["lm_head"]),
    "everything": dict(r=6, lora_alpha=12, target_modules=LINEAR + r"|model\.embed_tokens|lm_head"),
}
UNTIED_KINDS = {  # the head's own re-trained rows
    "head_tokens": dict(
        r=4, lora_alpha=8, target_modules=["k_proj"], trainable_token_indices={"lm_head": HEAD_TOKENS}
    ),
}
TIED_KINDS = {  # PEFT saves both sides' copies, one matrix
    "own_both": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        modules_to_save=["embed_tokens"],
        ensure_weight_tying=True,
    ),
}
MODELS = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True), TIED_KINDS),
    "qwen2": ("qwen2", {}, UNTIED_KINDS),
    "qwen3_moe": ("qwen3_moe", TINY_MOE, UNTIED_KINDS),
}
DECODE_STEPS = 32


def build_vocab_adapter(base_dir, path, seed: int, **lora):
    """A PEFT checkpoint of random LoRA (init_lora_weights=False) whose re-trained rows and own
    copies are moved off the base's too (PEFT starts them equal to it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "trainable_tokens_delta" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(MODELS))
def vocab_model(request, tmp_path_factory):
    """(model folder, adapter name -> folder)."""
    model_type, overrides, extra = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    folder = build_tiny_model(root / "model", model_type, **overrides)
    kinds = KINDS | extra
    adapters = {
        name: build_vocab_adapter(folder, root / name, seed=i + 1, **lora)
        for i, (name, lora) in enumerate(kinds.items())
    }
    return folder, adapters


def _rows_and_prompts(names: list[str]) -> tuple[list, list[list[int]]]:
    """10 rows: the base model and every adapter, some twice; random prompts with re-trained rows
    among their tokens."""
    adapters = ([None, *names] * 2)[:10]
    gen = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(len(adapters)):
        prompt = torch.randint(3, 158, (5 + i % 4,), generator=gen).tolist()
        prompt[1::3] = [(TOKENS + HEAD_TOKENS)[(i + j) % 7] for j in range(len(prompt[1::3]))]
        prompts.append(prompt)
    return [(a, len(p)) for a, p in zip(adapters, prompts, strict=True)], prompts


def test_every_vocabulary_side_adapter_kind_matches_peft_in_one_mixed_batch(vocab_model):
    _assert_matches_peft(*vocab_model, kernels=False)


@pytest.mark.parametrize("vocab_model", ["llama-tied"], indirect=True)
def test_the_triton_path_matches_peft_too(vocab_model):
    """The parts read by vocab_rows and vocab_times, attention and LoRA by theirs (in the
    interpreter here, 4 decode steps; the tied model has every kind)."""
    _assert_matches_peft(*vocab_model, kernels=True)


def _assert_matches_peft(model_dir, adapter_dirs, kernels: bool) -> None:
    reference = PerAdapterPeft(model_dir, adapter_dirs)
    runner, slots, _ = _runner(model_dir, adapter_dirs)
    rows, prompts = _rows_and_prompts(list(adapter_dirs))
    steps = 4 if kernels else DECODE_STEPS
    assert_decode_agrees(runner, slots, reference, rows, steps, seed=0, kernels=kernels, prompts=prompts)


def test_four_ranks_hold_their_vocabulary_rows_of_every_part_and_give_pefts_tokens(tmp_path):
    """Each rank holds its rows of the embedding and head and of every adapter's parts on them
    (158 tokens: 40 rows a rank, the last one's two past the vocabulary), re-trained rows on
    three of the four; tokens and logits as on one rank. The decoder's LoRA fully sharded: the
    vocabulary side splits alike either way."""
    model_dir = build_tiny_model(tmp_path / "model", "qwen2", vocab_size=158)
    kinds = KINDS | UNTIED_KINDS
    adapters = {
        name: build_vocab_adapter(model_dir, tmp_path / name, i + 1, **lora)
        for i, (name, lora) in enumerate(kinds.items())
    }
    reference = PerAdapterPeft(model_dir, adapters)
    rows, prompts = _rows_and_prompts(list(adapters))
    _assert_ranks_agree(
        4, model_dir, adapters, reference, rows, 4, seed=0, fully_sharded=True, prompts=prompts
    )


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_vocabulary_side_adapters_on_a_quantized_base_match_peft(quantization, tmp_path):
    """The decoder's linear layers quantized (PEFT over torchao's int8 and bitsandbytes' NF4
    layers; float64 over their dequantized weights), the embedding and head dense."""
    from .test_quantized_reference import quantized_base

    model_dir = build_tiny_model(tmp_path / "model", "qwen2", intermediate_size=128)  # whole NF4 blocks
    adapters = {
        name: build_vocab_adapter(model_dir, tmp_path / name, i + 1, **lora)
        for i, (name, lora) in enumerate(KINDS.items())
    }
    reference = PerAdapterPeft(model_dir, adapters, quantized_base(model_dir, quantization))
    runner, slots, _ = _runner(model_dir, adapters, quantization)
    rows, prompts = _rows_and_prompts(list(adapters))
    assert_decode_agrees(runner, slots, reference, rows, DECODE_STEPS, seed=0, prompts=prompts)


def test_re_trained_head_rows_on_a_tied_model_are_refused(tmp_path):
    """The tied head is the embedding: its rows are re-trained as the embedding's, so rows of the
    head alone would change the embedding PEFT serves too; refused, pointing at embed_tokens."""
    from shared.base_vocab import BaseVocab
    from shared.errors import InvalidArgument
    from shared.model_config import ModelConfig
    from shared.peft_checkpoint import load_peft_adapter

    model_dir = build_tiny_model(tmp_path / "model", tie_word_embeddings=True)
    lora = dict(
        r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices={"lm_head": HEAD_TOKENS}
    )
    folder = build_vocab_adapter(model_dir, tmp_path / "head_rows", 1, **lora)
    model = ModelConfig.from_dir(model_dir)
    with pytest.raises(InvalidArgument, match="re-train the rows of embed_tokens"):
        load_peft_adapter("head_rows", folder, model, 16, torch.float32, BaseVocab(model_dir, model))

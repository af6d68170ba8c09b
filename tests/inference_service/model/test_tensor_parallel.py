"""Tensor parallelism at the model: N ranks, each a process holding its part of the weights and
of every adapter, run a mixed batch (adapters on every module and the base model) in one gloo
group. Rank 0's logits agree with transformers + PEFT's as closely as fp32 allows: splitting a
matmul's sum over the ranks and adding the partial sums is one more order of the same fp32
additions, which the fp32 bound (tests/fp32_agreement.py) already spans; greedy tokens equal at
every step. TP=4 on the tiny models replicates their 2 KV heads."""

import json

import pytest
import torch
from torch import nn

from inference_service.engine.block_manager import BlockManager
from inference_service.model.forward_batch import SequenceInput
from inference_service.model.shard import Shard
from shared.errors import InvalidArgument
from shared.model_config import ModelConfig
from tests.conftest import TINY_ADAPTERS, build_peft_adapter, build_tiny_model
from tests.fp32_agreement import assert_fp32_agrees
from tests.inference_service.model.test_moe_reference import ROWS as MOE_ROWS
from tests.inference_service.model.test_moe_reference import PerAdapterPeft, build_moe_model
from tests.inference_service.model.test_peft_reference import (
    DECODE_STEPS,
    ROWS,
    Peft,
    _runner,
    _with_adapters,
)
from tests.inference_service.model.test_quantized_reference import (
    _dequantized_weight,
    _quantized_peft,
    _saved,
)
from tests.tensor_parallel import run_ranks

WIDE = dict(r=40, lora_alpha=80, target_modules="all-linear")


def _largest_rank(folder) -> int:
    """The largest rank an adapter folder's config names."""
    config = json.loads((folder / "adapter_config.json").read_text())
    return max([config["r"], *config.get("rank_pattern", {}).values()])


def _rank_logits(
    parallel, model_dir, adapter_dirs, sequences, adapters, steps, kernels, quantization
) -> list[torch.Tensor]:
    """On one rank: the prefill of `sequences` (every logit), then a decode step per list of
    `steps` (each sequence's next token); every step's logits. kernels: the Triton kernels' path
    (in the interpreter here); quantization: the base's format."""
    largest = max(_largest_rank(folder) for folder in adapter_dirs.values())
    runner, slots, _ = _runner(model_dir, adapter_dirs, quantization, parallel, max(16, largest))
    blocks = BlockManager(runner.num_blocks)
    block_size = runner.config.block_size
    tables = [blocks.allocate(-(-(len(s) + len(steps)) // block_size)) for s in sequences]
    slot_of = [-1 if a is None else slots[a] for a in adapters]
    batch = [SequenceInput(s, 0, t, slot) for s, t, slot in zip(sequences, tables, slot_of, strict=True)]
    logits = [runner.forward(batch, all_logits=True, kernels=kernels)]
    lengths = [len(s) for s in sequences]
    for step, tokens in enumerate(steps):
        decode = [
            SequenceInput([tok], n + step, t, slot)
            for tok, n, t, slot in zip(tokens, lengths, tables, slot_of, strict=True)
        ]
        logits.append(runner.forward(decode, kernels=kernels))
    return logits


def _assert_ranks_agree(
    size: int,
    model_dir,
    adapter_dirs,
    reference,
    rows,
    decode_steps: int,
    seed: int,
    fully_sharded: bool = False,
    kernels: bool = False,
    quantization: str = "none",
    prompts: list[list[int]] | None = None,
):
    """The prefill of one random prompt (or `prompts`) per row (adapter name or None, length),
    then `decode_steps` greedy steps on the reference's tokens, on `size` ranks: every step's
    logits as close to the reference's float64 forward as its fp32 forward is, greedy tokens
    equal."""
    gen = torch.Generator().manual_seed(seed)
    sequences = prompts or [torch.randint(3, 160, (n,), generator=gen).tolist() for _, n in rows]
    adapters = [a for a, _ in rows]
    expected = [reference.logits(sequences, adapters)]  # per step: (fp32, float64) per sequence
    steps, grown = [], sequences
    for _ in range(decode_steps):  # the reference's greedy tokens
        steps.append([int(e[-1].argmax()) for e in expected[-1][0]])
        grown = [[*s, tok] for s, tok in zip(grown, steps[-1], strict=True)]
        expected.append(reference.logits(grown, adapters))

    args = (model_dir, adapter_dirs, sequences, adapters, steps, kernels, quantization)
    got = run_ranks(size, _rank_logits, *args, fully_sharded=fully_sharded)

    (fp32, fp64), *decoded = expected
    assert_fp32_agrees(got[0], torch.cat(fp32), torch.cat(fp64))
    for step, ((fp32, fp64), logits) in enumerate(zip(decoded, got[1:], strict=True)):
        last32, last64 = torch.stack([e[-1] for e in fp32]), torch.stack([e[-1] for e in fp64])
        assert_fp32_agrees(logits, last32, last64)
        assert logits.argmax(dim=-1).tolist() == last32.argmax(dim=-1).tolist(), f"decode step {step}"


@pytest.mark.parametrize(("model_type", "size"), [("llama", 2), ("llama", 4), ("qwen2", 2)])
def test_ranks_give_pefts_logits_and_greedy_tokens(model_type, size, tiny_models, tiny_adapters):
    """Adapters on every module (attention and MLP), of ranks 2 to 16, with rsLoRA and rank
    patterns; Qwen2's q/k/v biases split with their rows."""
    model_dir, adapter_dirs = tiny_models[model_type], tiny_adapters[model_type]
    reference = Peft(model_dir, adapter_dirs)
    _assert_ranks_agree(size, model_dir, adapter_dirs, reference, ROWS, DECODE_STEPS, seed=5)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, tuple]:
    """model type -> (folder, adapter name -> folder), as the MoE reference test builds them."""
    return {
        model_type: build_moe_model(tmp_path_factory, model_type) for model_type in ("qwen3_moe", "qwen2_moe")
    }


@pytest.mark.parametrize(
    ("model_type", "size", "fully_sharded"),
    [("qwen3_moe", 2, False), ("qwen3_moe", 4, False), ("qwen2_moe", 2, False), ("qwen2_moe", 2, True)],
    ids=["qwen3_moe-2", "qwen3_moe-4", "qwen2_moe-2", "qwen2_moe-2-fully-sharded"],
)
def test_ranks_split_every_expert_and_give_pefts_logits(model_type, size, fully_sharded, moe_models):
    """Each rank holds its part of every expert's intermediate dimension (and of Qwen2-MoE's
    shared expert), the router whole; adapters on attention, router and experts, split with
    their layers or fully sharded (the experts' and the shared expert's LoRA too)."""
    model_dir, adapter_dirs = moe_models[model_type]
    reference = PerAdapterPeft(model_dir, adapter_dirs)
    _assert_ranks_agree(
        size, model_dir, adapter_dirs, reference, MOE_ROWS, 4, seed=2, fully_sharded=fully_sharded
    )


def test_a_model_the_ranks_cannot_split_is_refused_naming_both_numbers(tiny_models):
    cfg = ModelConfig.from_dir(tiny_models["llama"])  # 4 heads, 2 KV heads, intermediate 96
    with pytest.raises(
        InvalidArgument, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"
    ):
        Shard(0, 3).config(cfg)
    with pytest.raises(
        InvalidArgument, match="tensor_parallel_size 8 does not divide the model's 4 attention"
    ):
        Shard(0, 8).config(cfg)


@pytest.fixture(scope="module")
def wide_adapters(tiny_models, tiny_adapters, tmp_path_factory) -> dict[str, dict]:
    """The tiny adapters plus one of rank 40 on every module: split over 2 ranks, each holds 20
    of its rank rows, in 3 pages (the gathered shrinks are read page after page)."""
    root = tmp_path_factory.mktemp("wide")
    return {
        model_type: tiny_adapters[model_type]
        | {"wide40": build_peft_adapter(tiny_models[model_type], root / model_type, 9, **WIDE)}
        for model_type in ("llama", "qwen2")
    }


@pytest.mark.parametrize(
    ("model_type", "size", "kernels"),
    [("llama", 2, False), ("llama", 4, False), ("qwen2", 2, False), ("llama", 2, True)],
    ids=["llama-2", "llama-4", "qwen2-2", "llama-2-triton"],
)
def test_fully_sharded_adapters_give_pefts_logits_and_greedy_tokens(
    model_type, size, kernels, tiny_models, wide_adapters
):
    """S-LoRA's split: a column layer's A by rank rows, its shrinks gathered; a row layer's A and
    B both split, its shrinks summed. On the torch path and the Triton kernels' path."""
    model_dir, adapter_dirs = tiny_models[model_type], wide_adapters[model_type]
    reference = Peft(model_dir, adapter_dirs)
    steps = 2 if kernels else DECODE_STEPS
    rows = [*ROWS, ("wide40", 6)]
    _assert_ranks_agree(
        size, model_dir, adapter_dirs, reference, rows, steps, 5, fully_sharded=True, kernels=kernels
    )


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> tuple:
    """A tiny Llama 128 wide (intermediate 256), whose halves are whole NF4 blocks of 64, and its
    adapters."""
    root = tmp_path_factory.mktemp("wide-llama")
    folder = build_tiny_model(root / "llama", hidden_size=128, intermediate_size=256)
    adapters = {
        name: build_peft_adapter(folder, root / name, seed=i + 1, **lora)
        for i, (name, lora) in enumerate(TINY_ADAPTERS.items())
    }
    return folder, adapters


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_ranks_over_a_quantized_base_give_pefts_logits_and_greedy_tokens(quantization, wide_model):
    """Each rank quantizes its part as one device would: an int8 row-parallel layer's columns keep
    the scales of their whole rows; an NF4 part is whole blocks. Against PEFT over torchao's and
    bitsandbytes' layers."""
    model_dir, adapter_dirs = wide_model
    reference = _quantized_peft(model_dir, adapter_dirs, quantization)
    _assert_ranks_agree(2, model_dir, adapter_dirs, reference, ROWS, 4, seed=6, quantization=quantization)


@pytest.mark.parametrize("library", ["torchao", "bitsandbytes"])
def test_ranks_load_their_parts_of_a_checkpoint_saved_pre_quantized(library, wide_model, tmp_path):
    """int8 as torchao saves it (codes and a scale per row), NF4 as bitsandbytes saves it (codes,
    double-quantized absmax): each rank cuts its rows or columns from the saved parts."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import BitsAndBytesConfig, TorchAoConfig

    model_dir, adapter_dirs = wide_model
    config = (
        TorchAoConfig(Int8WeightOnlyConfig(set_inductor_config=False))
        if library == "torchao"
        else BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    )  # fmt: skip
    folder, quantized = _saved(model_dir, config, tmp_path)
    reference = _saved_reference(model_dir, folder, quantized, adapter_dirs)
    _assert_ranks_agree(2, folder, adapter_dirs, reference, ROWS, 2, seed=7)


def _saved_reference(model_dir, folder, quantized, adapter_dirs) -> Peft:
    """PEFT over the library's in-memory quantized model, and over the weights it computes with
    in float64."""
    from transformers import AutoModelForCausalLM

    for module in quantized.modules():  # bitsandbytes' fused AVX-512 bf16 path differs by ~3e-3
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    fp64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).double()
    layers = dict(quantized.named_modules())
    for name, module in fp64.named_modules():
        weight = _dequantized_weight(layers[name]) if name in layers else None
        if isinstance(module, nn.Linear) and weight is not None:
            module.weight.data = weight
    return Peft(folder, adapter_dirs, [_with_adapters(m, adapter_dirs) for m in (quantized, fp64)])


def test_an_nf4_base_the_ranks_would_split_mid_block_is_refused_naming_the_layer(tiny_models):
    cfg = ModelConfig.from_dir(tiny_models["llama"])  # hidden 64: o_proj's halves are 32 columns
    with pytest.raises(InvalidArgument, match=r"rank 0's columns 0..32 of o_proj \(64 x 64\) would split"):
        Shard(0, 2).check_quantized(cfg, "nf4")
    Shard(0, 2).check_quantized(cfg, "int8")  # int8 splits anywhere

"""AdapterImage: an adapter laid out as its pages of adapter memory, checked row by row against
the layout kernels/lora_batch.py defines, and refused where the model cannot take it."""

import re

import pytest
import torch

from inference_service.adapters.adapter_image import AdapterImage
from kernels.lora_batch import PAGE_RANK
from shared.model_config import ModelConfig
from shared.peft_checkpoint import AdapterWeights, ModuleLora


def _weights(model: ModelConfig, ranks: dict[tuple[int, str], int]) -> AdapterWeights:
    shapes, generator = model.linear_shapes(), torch.Generator().manual_seed(0)
    modules = {
        (layer, module): ModuleLora(
            torch.randn(rank, shapes[module].in_features, generator=generator),
            torch.randn(rank, shapes[module].out_features, generator=generator),
        )
        for (layer, module), rank in ranks.items()
    }
    return AdapterWeights(max(ranks.values()), 16.0, tuple({m for _, m in ranks}), modules)


def _expected_page(weights: AdapterWeights, layer: int, module: str, page: int, model: ModelConfig):
    """Page `page` of one layer as the layout defines it: rank rows 8*page .. 8*page + 7 of A,
    then of B^T, zeros past the module's rank and for a layer it does not adapt."""
    shape = model.linear_shapes()[module]
    a, b_t = torch.zeros(PAGE_RANK, shape.in_features), torch.zeros(PAGE_RANK, shape.out_features)
    lora = weights.modules.get((layer, module))
    if lora is not None:
        rows = lora.a[PAGE_RANK * page : PAGE_RANK * (page + 1)]
        a[: len(rows)] = rows
        b_t[: len(rows)] = lora.b_t[PAGE_RANK * page : PAGE_RANK * (page + 1)]
    return torch.cat([a.flatten(), b_t.flatten()])


def _dirty_freed_memory(image: AdapterImage) -> None:
    """NaN in memory the allocator hands out next for an image of this size: zeros in the image
    must be written, not found in fresh memory."""
    for pages in image.pages:
        pages.fill_(float("nan"))


def test_every_page_of_every_layer_holds_its_rank_rows_and_zeros_elsewhere(tiny_models):
    model = ModelConfig.from_dir(tiny_models["llama"])
    ranks = {(0, "q_proj"): 8, (1, "q_proj"): 12, (1, "v_proj"): 16, (0, "down_proj"): 3}
    weights = _weights(model, ranks)
    _dirty_freed_memory(AdapterImage.of(weights, model, torch.float32))
    image = AdapterImage.of(weights, model, torch.float32)
    assert image.ranks == (12, 0, 16, 0, 0, 0, 3)
    # the largest rank of each target over layers; then no vocabulary-side run
    assert image.need == (2, 0, 2, 0, 0, 0, 1, 0)
    for target, pages in zip(model.lora_targets, image.pages[:-1], strict=True):
        for page in range(pages.shape[0]):
            for layer in range(model.num_layers):
                expected = _expected_page(weights, layer, target, page, model)
                assert torch.equal(pages[page, layer], expected), (target, page, layer)


MOE = dict(
    model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
    num_experts_per_tok=2,
)  # fmt: skip


def test_an_expert_targets_page_holds_every_experts_rank_rows_one_block_after_another():
    model = ModelConfig.from_dict(MOE)
    generator = torch.Generator().manual_seed(0)
    a, b_t = (
        torch.randn(4, 10, 32, generator=generator),
        torch.randn(4, 10, 16, generator=generator),
    )  # [E, r, *]
    weights = AdapterWeights(10, 20.0, ("gate_proj",), {(1, "gate_proj"): ModuleLora(a, b_t)})
    _dirty_freed_memory(AdapterImage.of(weights, model, torch.float32))
    image = AdapterImage.of(weights, model, torch.float32)
    gate = model.lora_targets.index("gate_proj")
    assert model.lora_targets == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "router",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert image.need == (0, 0, 0, 0, 0, 2, 0, 0, 0)
    pages = image.pages[gate]  # [2, layers, experts * 8 * (32 + 16)]
    assert pages.shape == (2, 2, 4 * PAGE_RANK * 48)
    assert (pages[:, 0] == 0).all()  # layer 0 left alone
    blocks = pages[:, 1].unflatten(1, (4, PAGE_RANK * 48))  # [pages, experts, block]
    for expert in range(4):
        for page in range(2):
            rows = slice(PAGE_RANK * page, PAGE_RANK * (page + 1))
            want_a, want_b = torch.zeros(PAGE_RANK, 32), torch.zeros(PAGE_RANK, 16)
            want_a[: len(a[expert, rows])], want_b[: len(a[expert, rows])] = (
                a[expert, rows],
                b_t[expert, rows],
            )
            assert torch.equal(blocks[page, expert], torch.cat([want_a.flatten(), want_b.flatten()])), (
                expert,
                page,
            )


def test_an_expert_lora_for_another_expert_count_is_refused():
    model = ModelConfig.from_dict(MOE)
    lora = ModuleLora(torch.zeros(3, 4, 32), torch.zeros(3, 4, 16))  # 3 experts, the model has 4
    with pytest.raises(ValueError, match=re.escape("gate_proj: A (3, 4, 32) and B^T (3, 4, 16) do not fit")):
        AdapterImage.of(
            AdapterWeights(4, 8.0, ("gate_proj",), {(0, "gate_proj"): lora}), model, torch.float32
        )


def test_the_image_is_in_the_serving_dtype(tiny_models):
    model = ModelConfig.from_dir(tiny_models["llama"])
    weights = _weights(model, {(0, "q_proj"): 8})
    image = AdapterImage.of(weights, model, torch.bfloat16)
    assert image.pages[0].dtype == torch.bfloat16
    a = weights.modules[0, "q_proj"].a  # [8, hidden]
    assert torch.equal(image.pages[0][0, 0, : a.numel()], a.bfloat16().flatten())


@pytest.mark.parametrize(
    "key, rows, cols, message",
    [
        ((2, "q_proj"), 4, None, "layers.2.q_proj: the model has layers 0..1"),
        ((-1, "q_proj"), 4, None, "layers.-1.q_proj: the model has layers 0..1"),
        ((0, "q_proj"), 4, 7, "q_proj: A (4, 7) and B^T"),
    ],
)
def test_weights_the_model_cannot_take_are_refused(tiny_models, key, rows, cols, message):
    model = ModelConfig.from_dir(tiny_models["llama"])
    shape = model.linear_shapes()[key[1]]
    lora = ModuleLora(torch.ones(rows, cols or shape.in_features), torch.ones(rows, shape.out_features))
    weights = AdapterWeights(rows, 16.0, (key[1],), {key: lora})
    with pytest.raises(ValueError, match=re.escape(message)):
        AdapterImage.of(weights, model, torch.float32)

"""AdapterImage: an adapter laid out as its pages of adapter memory, checked row by row against
the layout kernels/lora_batch.py defines, and refused where the model cannot take it."""

import re

import pytest
import torch

from inference_service.adapters.adapter_image import AdapterImage
from kernels.lora_batch import PAGE_RANK
from shared.model_config import LORA_TARGETS, ModelConfig
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
    assert image.need == (2, 0, 2, 0, 0, 0, 1)  # the largest rank of each target over layers
    for target, pages in zip(LORA_TARGETS, image.pages, strict=True):
        for page in range(pages.shape[0]):
            for layer in range(model.num_layers):
                expected = _expected_page(weights, layer, target, page, model)
                assert torch.equal(pages[page, layer], expected), (target, page, layer)


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

"""One sparse MLP layer with LoRA on its router and every expert, against the math PEFT computes:
each adapter's deltas merged into the router's and the experts' weights (scaling * B @ A), then
the layer run as transformers runs it. Ours adds each delta to the base output instead; both are
held to the merged layer in float64, ours within what the merged layer's own fp32 forward costs
(tests/fp32_agreement.py)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.engine.adapter_memory import AdapterMemory, page_units, unit_elements
from inference_service.model.moe import SparseMoe
from inference_service.model.placement import Placement
from kernels.cpu_linear import CpuLinear
from kernels.lora_batch import AdapterPages, LoraBatch
from shared.model_config import ModelConfig
from shared.peft_checkpoint import AdapterWeights, ModuleLora
from tests.fp32_agreement import assert_fp32_agrees, rms

MODEL = ModelConfig.from_dict(
    {
        "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    }
)  # fmt: skip
TOKENS, RANK = 24, 8


def _adapter(gen) -> AdapterWeights:
    """Random LoRA (scaling merged) on the router and on every expert's gate, up and down."""
    moe, hidden = MODEL.moe, MODEL.hidden_size

    def lora(*stack, fan_in, fan_out):
        return ModuleLora(
            torch.randn(*stack, RANK, fan_in, generator=gen) * 0.2,
            torch.randn(*stack, RANK, fan_out, generator=gen) * 0.2,
        )

    modules = {
        (0, "router"): lora(fan_in=hidden, fan_out=moe.num_experts),
        (0, "gate_proj"): lora(moe.num_experts, fan_in=hidden, fan_out=moe.intermediate_size),
        (0, "up_proj"): lora(moe.num_experts, fan_in=hidden, fan_out=moe.intermediate_size),
        (0, "down_proj"): lora(moe.num_experts, fan_in=moe.intermediate_size, fan_out=hidden),
    }
    return AdapterWeights(RANK, 16.0, ("down_proj", "gate_proj", "router", "up_proj"), modules)


def _merged(base: tuple[torch.Tensor, ...], adapter: AdapterWeights, dtype) -> tuple[torch.Tensor, ...]:
    """The router, w13 and w2 (`base`) with the adapter's deltas merged in float64, then cast to
    dtype."""
    m = adapter.modules
    delta = {name: m[0, name].b_t.double().transpose(-1, -2) @ m[0, name].a.double() for _, name in m}
    router = base[0].double() + delta["router"]
    w13 = base[1].double() + torch.cat([delta["gate_proj"], delta["up_proj"]], dim=1)
    w2 = base[2].double() + delta["down_proj"]
    return router.to(dtype), w13.to(dtype), w2.to(dtype)


def _reference(x: torch.Tensor, router, w13, w2) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3-MoE block on merged weights: (output [tokens, hidden], top-k ids)."""
    probs = F.linear(x, router).softmax(dim=-1)  # [tokens, experts]
    weights, ids = probs.topk(MODEL.moe.top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(MODEL.moe.top_k):
            gate, up = F.linear(x[t], w13[ids[t, k]]).chunk(2)
            out[t] += weights[t, k] * F.linear(F.silu(gate) * up, w2[ids[t, k]])
    return out, ids


@pytest.mark.parametrize("experts", ["dense", "packed"])
def test_one_moe_layer_with_lora_on_router_and_experts_matches_the_merged_layer(experts):
    """packed: the experts' weights laid out for the CPU's matmuls (as a CPU engine packs them)."""
    gen = torch.Generator().manual_seed(0)
    unit, units = unit_elements(MODEL), sum(page_units(MODEL))  # room for one rank-8 adapter
    memory = AdapterMemory.for_model(units, MODEL, torch.float32)
    pool = torch.zeros(units * unit)  # the layer's adapter memory
    layer = SparseMoe(MODEL, pool, unit, Placement(torch.float32, "cpu"))
    for weight in (layer.router.base.weight, layer.w13, layer.w2):
        weight.copy_(torch.randn(weight.shape, generator=gen) * 0.2)
    base = tuple(w.detach().clone() for w in (layer.router.base.weight, layer.w13, layer.w2))
    if experts == "packed":
        layer.pack(CpuLinear.load()[0])
        assert layer.packed is not None and layer.w13.numel() == layer.w2.numel() == 0  # dense ones let go
    adapter = _adapter(gen)
    image = AdapterImage.of(adapter, MODEL, torch.float32)
    slot, _ = memory.acquire("a", image.need)
    for units, pages in zip(memory.pages(slot), image.pages, strict=True):
        for u, page in zip(units, pages, strict=True):
            pool[u * unit : u * unit + page.shape[1]] = page[0]  # layer 0 of the page
    x = torch.randn(TOKENS, MODEL.hidden_size, generator=gen)
    slots = [slot if t % 3 else -1 for t in range(TOKENS)]  # every third token on the base layer
    pages = {slot: AdapterPages(image.ranks, memory.pages(slot)[:-1])}  # the LoRA targets' pages
    batch = SimpleNamespace(lora=LoraBatch.build(slots, pages), kernels=False)

    ours = layer(x, batch)

    on = torch.tensor([s >= 0 for s in slots])
    expected, exact = torch.empty_like(x), torch.empty(x.shape, dtype=torch.float64)
    for rows, weights in ((on, _merged(base, adapter, torch.float64)), (~on, base)):
        exact[rows], ids64 = _reference(x[rows].double(), *(w.double() for w in weights))
        expected[rows], ids32 = _reference(x[rows], *(w.float() for w in weights))
        assert torch.equal(ids32, ids64), "a near-tie in the reference's routing: pick another seed"
    assert_fp32_agrees(ours, expected, exact)
    print(f"relative RMS error against float64: {rms(ours - exact) / rms(exact):.2g}")


def test_experts_the_cpus_matmuls_cannot_take_stay_dense():
    """fp16 has no CPU layout (packed_weight.packed gives None): pack leaves every expert dense,
    and the layer runs on torch's matmuls as before."""
    unit, units = unit_elements(MODEL), sum(page_units(MODEL))
    layer = SparseMoe(
        MODEL, torch.zeros(units * unit, dtype=torch.float16), unit, Placement(torch.float16, "cpu")
    )
    layer.w13.copy_(torch.randn(layer.w13.shape) * 0.2)
    dense = layer.w13.clone()

    layer.pack(CpuLinear.load()[0])

    assert layer.packed is None and torch.equal(layer.w13, dense)

"""moe_gemm (torch, grouped by expert) and moe_gemm_triton against a float64 per-pair reference;
ExpertPlan's grouping and combine's weighted sum."""

import pytest
import torch

from inference_service.model.packed_weight import packed
from kernels.cpu_linear import CpuLinear
from kernels.moe_gemm import BLOCK_M, ExpertPlan, combine, moe_gemm, moe_gemm_packed, moe_gemm_triton
from tests.kernels.rounding import assert_within, cast_error, fp32_error, gamma

EXPERTS = 8


def routing(tokens: int, top_k: int, seed: int, crowd: int | None = None) -> torch.Tensor:
    """topk_ids [tokens, top_k], distinct experts per token; with `crowd`, every token picks that
    expert first (more pairs than one tile holds), and experts 6 and 7 are never picked."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS - 2, generator=gen)[:top_k] for _ in range(tokens)])
    if crowd is not None:
        ids[:, 0] = crowd
        ids[:, 1:] = torch.where(ids[:, 1:] == crowd, (crowd + 1) % (EXPERTS - 2), ids[:, 1:])
    return ids


def per_pair(x: torch.Tensor, weight: torch.Tensor, plan: ExpertPlan, gather: bool) -> torch.Tensor:
    """The float64 reference: every sorted row's product with its own expert's weight."""
    experts = torch.repeat_interleave(torch.arange(len(plan.counts)), torch.tensor(plan.counts))  # [pairs]
    rows = x[plan.tokens] if gather else x
    return torch.einsum("pi,poi->po", rows.double(), weight.double()[experts])  # [pairs, out]


def test_the_plan_groups_pairs_by_expert_in_token_order_and_tiles_never_mix_experts():
    ids = routing(40, 2, seed=0, crowd=3)
    plan = ExpertPlan.build(ids, EXPERTS)
    experts = ids.flatten()[plan.order]  # [pairs]
    assert plan.counts == tuple(torch.bincount(ids.flatten(), minlength=EXPERTS).tolist())
    assert plan.counts[6] == plan.counts[7] == 0 and plan.counts[3] == 40 > BLOCK_M
    assert torch.equal(experts, experts.sort().values)
    for e in range(EXPERTS):  # within an expert, token order
        tokens = plan.tokens[experts == e]
        assert torch.equal(tokens, tokens.sort().values)
    assert torch.equal(plan.tokens, plan.order // 2)
    for expert, start, end in zip(plan.tile_experts, plan.tile_starts, plan.tile_ends, strict=True):
        assert 0 < end - start <= BLOCK_M
        assert (experts[start:end] == expert).all()
    assert sum(int(e - s) for s, e in zip(plan.tile_starts, plan.tile_ends, strict=True)) == plan.pairs


@pytest.mark.parametrize("gather", [True, False], ids=["tokens", "sorted-rows"])
@pytest.mark.parametrize(("tokens", "top_k", "crowd"), [(1, 2, None), (9, 2, None), (40, 2, 3), (5, 4, None)])
def test_torch_form_equals_each_pairs_own_product(tokens, top_k, crowd, gather):
    torch.manual_seed(tokens)
    plan = ExpertPlan.build(routing(tokens, top_k, seed=tokens, crowd=crowd), EXPERTS)
    x = torch.randn(tokens if gather else plan.pairs, 48)
    weight = torch.randn(EXPERTS, 80, 48) * 0.1

    got = moe_gemm(x, weight, plan, gather)

    # each row is F.linear of one row, as a dense layer computes it: bound it the same way
    size = per_pair(x.abs(), weight.abs(), plan, gather)
    assert_within(got, per_pair(x, weight, plan, gather), gamma(48 * fp32_error(x.device)) * size)


@pytest.mark.parametrize("gather", [True, False], ids=["tokens", "sorted-rows"])
@pytest.mark.parametrize(("tokens", "top_k", "crowd"), [(1, 2, None), (9, 2, None), (40, 2, 3), (5, 4, None)])
@pytest.mark.parametrize("kernel", ["panels", "onednn"])
def test_packed_form_equals_each_pairs_own_product(tokens, top_k, crowd, gather, kernel):
    """Each expert's weight laid out for the CPU (the compiled panels, or oneDNN's blocks where they
    are not built), experts with no pairs among them; 80 outputs leave a panel part empty."""
    linear = CpuLinear.load()[0] if kernel == "panels" else None
    if kernel == "panels" and linear is None:
        pytest.skip("the CPU linear kernel is not built here")
    torch.manual_seed(tokens)
    plan = ExpertPlan.build(routing(tokens, top_k, seed=tokens, crowd=crowd), EXPERTS)
    x = torch.randn(tokens if gather else plan.pairs, 48)
    weight = torch.randn(EXPERTS, 80, 48) * 0.1
    weights = [packed(w, linear) for w in weight]

    got = moe_gemm_packed(x, weights, plan, gather)

    size = per_pair(x.abs(), weight.abs(), plan, gather)
    assert_within(got, per_pair(x, weight, plan, gather), gamma(48 * fp32_error(x.device)) * size)


@pytest.mark.parametrize("gather", [True, False], ids=["tokens", "sorted-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("tokens", "top_k", "crowd", "in_features", "out_features"),
    [(1, 2, None, 64, 64), (9, 2, None, 96, 80), (40, 2, 3, 200, 130)],
)
def test_triton_kernel_is_within_its_rounding_bound(
    tokens, top_k, crowd, in_features, out_features, dtype, gather
):
    """Masked tails in every dimension, an expert with more pairs than a tile, experts with none."""
    torch.manual_seed(in_features)
    plan = ExpertPlan.build(routing(tokens, top_k, seed=tokens, crowd=crowd), EXPERTS)
    x = torch.randn(tokens if gather else plan.pairs, in_features).to(dtype)
    weight = (torch.randn(EXPERTS, out_features, in_features) * 0.1).to(dtype)

    got = moe_gemm_triton(x, weight, plan, gather)

    s = in_features * fp32_error(x.device) + (cast_error(dtype) if dtype != torch.float32 else 0)
    assert got.dtype == dtype
    assert_within(
        got, per_pair(x, weight, plan, gather), gamma(s) * per_pair(x.abs(), weight.abs(), plan, gather)
    )


def test_combine_weighs_each_tokens_pairs_and_sums_them():
    ids = routing(6, 2, seed=1)
    plan = ExpertPlan.build(ids, EXPERTS)
    y = torch.randn(plan.pairs, 16)
    weights = torch.rand(6, 2)

    got = combine(y, plan, weights)

    in_pair_order = torch.empty_like(y)
    in_pair_order[plan.order] = y
    for t in range(6):
        expected = weights[t, 0] * in_pair_order[2 * t] + weights[t, 1] * in_pair_order[2 * t + 1]
        torch.testing.assert_close(got[t], expected, rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_at_qwen3_30b_a3bs_shape_on_a_gpu(dtype):
    """Compiled, at Qwen3-30B-A3B's expert shape (128 experts, 2048 -> 2 x 768), top-8 of 64
    tokens, within the same derived bound."""
    torch.manual_seed(0)
    ids = torch.stack([torch.randperm(128)[:8] for _ in range(64)]).cuda()
    plan = ExpertPlan.build(ids, 128)
    x = torch.randn(64, 2048, device="cuda").to(dtype)
    weight = (torch.randn(128, 1536, 2048, device="cuda") * 0.02).to(dtype)

    got = moe_gemm_triton(x, weight, plan, gather=True)

    experts = torch.repeat_interleave(
        torch.arange(128, device="cuda"), torch.tensor(plan.counts, device="cuda")
    )
    rows = x[plan.tokens].double()
    exact = torch.einsum("pi,poi->po", rows, weight.double()[experts])
    size = torch.einsum("pi,poi->po", rows.abs(), weight.double().abs()[experts])
    s = 2048 * fp32_error(x.device) + (cast_error(dtype) if dtype != torch.float32 else 0)
    assert_within(got, exact.cpu(), gamma(s) * size.cpu())

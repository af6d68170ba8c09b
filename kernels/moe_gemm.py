"""moe_gemm: one linear layer per expert, applied to the (token, expert) pairs of a batch that the
router chose, pairs grouped by expert so that each expert's weight is read once per step.

A layer's router gives every token top_k experts. ExpertPlan sorts those tokens * top_k pairs
by expert (stably: within an expert, in token order) once per layer and step; both of the sparse
MLP's linear layers (gate/up, then down) run over that order, and `combine` weighs each token's
pairs and sums them back into one row per token.

The torch form runs one matmul per expert that has pairs; the packed form does the same on each
expert's weight laid out for the CPU's matmuls (the CPU path, once the model is packed); the Triton
form is one launch over tiles of at most BLOCK_M pairs of one expert (a tile never mixes experts),
each program loading its pairs' input rows and its expert's weight tiles.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_in_fp32

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@dataclass(frozen=True)
class ExpertPlan:
    """A step's pairs in expert order. Sorted row r is pair order[r] = token * top_k + k, of
    token tokens[r], run by the expert whose range of rows holds r: expert e owns rows
    starts[e] .. starts[e] + counts[e]. tile_experts/tile_starts/tile_ends cut each expert's
    rows into tiles of at most BLOCK_M (the Triton form's programs)."""

    order: torch.Tensor  # [pairs] int64
    tokens: torch.Tensor  # [pairs] int64
    counts: tuple[int, ...]  # [experts]
    tile_experts: torch.Tensor  # [tiles] int32
    tile_starts: torch.Tensor  # [tiles] int32
    tile_ends: torch.Tensor  # [tiles] int32

    @property
    def pairs(self) -> int:
        return self.order.numel()

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        """(expert, its first row, the row after its last) of each expert with pairs."""
        return expert_spans(self.counts)

    @classmethod
    def build(cls, topk_ids: torch.Tensor, num_experts: int) -> "ExpertPlan":
        """topk_ids [tokens, top_k]: the experts each token's router chose."""
        top_k = topk_ids.shape[1]
        order = topk_ids.flatten().argsort(stable=True)  # [pairs]
        counts = torch.bincount(topk_ids.flatten(), minlength=num_experts).tolist()  # one host sync
        tiles = [
            (expert, row, min(row + BLOCK_M, end))
            for expert, start, end in expert_spans(counts)
            for row in range(start, end, BLOCK_M)
        ]
        experts, starts, ends = zip(*tiles, strict=True) if tiles else ((), (), ())

        def tensor(values):
            return torch.tensor(values, dtype=torch.int32, device=topk_ids.device)

        return cls(order, order // top_k, tuple(counts), tensor(experts), tensor(starts), tensor(ends))


def expert_spans(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with pairs, rows in expert order."""
    ends = list(itertools.accumulate(counts))
    return [
        (expert, end - count, end)
        for expert, (count, end) in enumerate(zip(counts, ends, strict=True))
        if count
    ]


def moe_gemm(x: torch.Tensor, weight: torch.Tensor, plan: ExpertPlan, gather: bool) -> torch.Tensor:
    """Semantics: y[r] = x[src(r)] @ weight[e(r)]^T for every sorted row r, e(r) the expert owning
    row r and src(r) = plan.tokens[r] when `gather` (x holds tokens) else r (x holds sorted
    rows, as the previous moe_gemm left them).

    x: [tokens or pairs, in]; weight: [experts, out, in] -> y [pairs, out] in x's dtype."""
    rows = x[plan.tokens] if gather else x  # [pairs, in]
    y = torch.empty(plan.pairs, weight.shape[1], dtype=x.dtype, device=x.device)  # [pairs, out]
    for expert, start, end in plan.spans:
        y[start:end] = F.linear(rows[start:end], weight[expert])
    return y


def moe_gemm_packed(x: torch.Tensor, weights: Sequence[Any], plan: ExpertPlan, gather: bool) -> torch.Tensor:
    """moe_gemm's semantics on weights laid out for the CPU (inference_service/model/packed_weight's
    PanelWeight or PackedWeight, one an expert): each expert's rows times its weight, in its own
    matmul. On the CPU's panels a decode step's experts at 32 tokens (hidden 1024, 32 experts of
    512, top 8) took 0.376 of the torch form's time, where MKL multiplies a few rows at a time.

    x: [tokens or pairs, in]; weights[e].linear(rows [n, in], None) -> [n, out] -> y [pairs, out]."""
    rows = x[plan.tokens] if gather else x  # [pairs, in]
    products = [weights[expert].linear(rows[start:end], None) for expert, start, end in plan.spans]
    return torch.cat(products)  # [pairs, out]


def moe_gemm_triton(x: torch.Tensor, weight: torch.Tensor, plan: ExpertPlan, gather: bool) -> torch.Tensor:
    """moe_gemm's semantics in one launch: a program per (tile, BLOCK_N columns) loads its rows of
    x (through plan.tokens when `gather`) and its expert's weight tiles, accumulating in fp32
    and rounding once to x's dtype.

    x: [tokens or pairs, in]; weight: [experts, out, in] -> y [pairs, out]."""
    _, out_features, in_features = weight.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    y = torch.empty(plan.pairs, out_features, dtype=x.dtype, device=x.device)
    tiles = plan.tile_experts.numel()
    if tiles == 0:
        return y
    grid = (tiles, triton.cdiv(out_features, BLOCK_N))
    _moe_gemm_kernel[grid](
        x, weight, y, plan.tokens, plan.tile_experts, plan.tile_starts, plan.tile_ends,
        out_features, in_features, x.stride(0), y.stride(0), GATHER=gather,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    return y


@triton.jit
def _moe_gemm_kernel(
    x_ptr, w_ptr, y_ptr, tokens_ptr, tile_experts_ptr, tile_starts_ptr, tile_ends_ptr,
    out_features, in_features, x_stride, y_stride, GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    start = tl.load(tile_starts_ptr + tile)
    end = tl.load(tile_ends_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)  # [M] sorted rows
    live = rows < end
    src = tl.load(tokens_ptr + rows, mask=live, other=0) if GATHER else rows  # [M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    w_base = w_ptr + expert * out_features * in_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [K]
        a = tl.load(
            x_ptr + src[:, None].to(tl.int64) * x_stride + ks[None, :],
            mask=live[:, None] & (ks[None, :] < in_features),
            other=0.0,
        )  # [M, K]
        w = tl.load(
            w_base + cols[None, :] * in_features + ks[:, None],
            mask=(cols[None, :] < out_features) & (ks[:, None] < in_features),
            other=0.0,
        )  # [K, N]
        acc += dot(a, w, DOT_FP32)
    mask = live[:, None] & (cols[None, :] < out_features)
    out = y_ptr + rows[:, None].to(tl.int64) * y_stride + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, plan: ExpertPlan, topk_weights: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t] = sum_k topk_weights[t, k] * y[row of pair (t, k)], the sum in k order.

    y: [pairs, hidden] sorted rows; topk_weights: [tokens, top_k] -> [tokens, hidden]."""
    tokens, top_k = topk_weights.shape
    pairs = torch.empty_like(y)  # [pairs, hidden] in pair order
    pairs[plan.order] = y
    return (pairs.view(tokens, top_k, -1) * topk_weights[..., None].to(y.dtype)).sum(dim=1)

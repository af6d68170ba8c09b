"""The sparse MLP of a mixture-of-experts decoder layer (Qwen3-MoE, Mixtral, OLMoE): a router
picks top_k experts per token, and each picked expert's SwiGLU MLP runs on the tokens that picked
it (kernels/moe_gemm.py), weighted by the router's probabilities."""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe_gemm import ExpertPlan, combine, moe_gemm, moe_gemm_triton
from shared.model_config import MoeConfig


class SparseMoe(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, dtype, device):
        super().__init__()
        self.moe = moe
        experts, inter = moe.num_experts, moe.intermediate_size

        def weight(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.router = weight(experts, hidden_size)
        self.w13 = weight(experts, 2 * inter, hidden_size)  # each expert's gate rows, then its up rows
        self.w2 = weight(experts, hidden_size, inter)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (topk_weights [tokens, top_k] fp32, topk_ids [tokens, top_k]):
        softmax over every expert in fp32, the top k, renormalized when the model says so."""
        probs = F.linear(x, self.router).float().softmax(dim=-1)  # [tokens, experts]
        weights, ids = probs.topk(self.moe.top_k, dim=-1)  # [tokens, top_k] each
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        plan = ExpertPlan.build(ids, self.moe.num_experts)
        gemm = moe_gemm_triton if x.is_cuda else moe_gemm
        gate, up = gemm(x, self.w13, plan, gather=True).chunk(2, dim=-1)  # [pairs, inter] each
        y = gemm(F.silu(gate) * up, self.w2, plan, gather=False)  # [pairs, hidden]
        return combine(y, plan, weights)  # [tokens, hidden]


def expert_weight_bytes(module: nn.Module) -> int:
    """Bytes the routers and experts of every sparse MLP under `module` hold."""
    return sum(
        p.numel() * p.element_size()
        for m in module.modules()
        if isinstance(m, SparseMoe)
        for p in m.parameters()
    )

"""The sparse MLP of a mixture-of-experts decoder layer (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): a
router picks top_k experts per token, and each picked expert's SwiGLU MLP runs on the tokens that
picked it (kernels/moe_gemm.py), weighted by the router's probabilities; Qwen2-MoE adds a shared
expert every token runs, its output scaled by sigmoid(shared_expert_gate(x)).

LoRA: the router is a LoRALinear (its logits gain each token's adapter's delta), and every expert
has its own LoRA on gate, up and down, applied to the (token, expert) pairs the router chose, each
pair with its token's adapter and its expert's block of that adapter's pages.
"""

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.model.forward_batch import ForwardBatch
from inference_service.model.lora_linear import LoraSplit, add_lora
from inference_service.model.packed_weight import PackedWeight, PanelWeight, packed
from inference_service.model.placement import Placement
from kernels.cpu_linear import CpuLinear
from kernels.lora_batch import LoraBatch, page_width
from kernels.moe_gemm import ExpertPlan, combine, moe_gemm, moe_gemm_packed, moe_gemm_triton
from shared.model_config import EXPERT_TARGETS, ModelConfig


class SparseMoe(nn.Module):
    """cfg: the model as this rank holds it. Under tensor parallelism each rank holds its part of
    every expert's intermediate dimension (and of the shared expert's), the router whole: its
    output is a partial sum, summed over the ranks once per layer."""

    def __init__(self, cfg: ModelConfig, pool: torch.Tensor, unit: int, place: Placement):
        super().__init__()
        self.parallel = place.parallel
        self.moe = moe = cfg.moe
        hidden, experts, inter = cfg.hidden_size, moe.num_experts, moe.intermediate_size
        self.router = place.linear(hidden, (experts,), False, (pool, unit, cfg.first_target("router")))

        def weight(*shape):
            return nn.Parameter(
                torch.empty(*shape, dtype=place.dtype, device=place.device), requires_grad=False
            )

        self.w13 = weight(experts, 2 * inter, hidden)  # each expert's gate rows, then its up rows
        self.w2 = weight(experts, hidden, inter)
        # each expert's w13 and w2 laid out for the CPU's matmuls, once pack() ran
        self.packed: tuple[tuple[PanelWeight | PackedWeight, ...], ...] | None = None
        shared = moe.shared_intermediate_size
        self.column, self.row = LoraSplit.of(self.parallel, "column"), LoraSplit.of(self.parallel, "row")
        if shared:  # Qwen2-MoE's shared expert, its output gated per token
            gate_up, down = (
                (pool, unit, cfg.first_target("shared_gate_up_proj")),
                (pool, unit, cfg.first_target("shared_down_proj")),
            )
            self.shared_gate_up_proj = place.linear(hidden, (shared, shared), False, gate_up, "column")
            self.shared_down_proj = place.linear(shared, (hidden,), False, down, "row")
            gate = (pool, unit, cfg.first_target("shared_expert_gate"))
            self.shared_expert_gate = place.linear(hidden, (1,), False, gate)
        self.pool, self.unit = pool, unit
        self.gate_up_target, self.down_target = (
            cfg.first_target("gate_up_proj"),
            cfg.first_target("down_proj"),
        )
        # units between two experts' blocks of a page (each PAGE_RANK rows of A then of B^T), on
        # the expert targets only
        shapes = cfg.linear_shapes()
        self.shifts = tuple(
            page_width(s.in_features, s.out_features, s.gathered) // unit if t in EXPERT_TARGETS else 0
            for t, s in shapes.items()
        )

    def route(self, x: torch.Tensor, lora: LoraBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (topk_weights [tokens, top_k] fp32, topk_ids [tokens, top_k]):
        softmax over every expert in fp32, the top k, renormalized when the model says so."""
        probs = self.router(x, lora).float().softmax(dim=-1)  # [tokens, experts]
        weights, ids = probs.topk(self.moe.top_k, dim=-1)  # [tokens, top_k] each
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def pack(self, linear: CpuLinear | None) -> None:
        """Once loaded, on a CPU: each expert's weights laid out for its matmuls
        (packed_weight.packed), the dense stacks let go; where any expert's cannot be, none is."""
        w13, w2 = tuple(packed(w, linear) for w in self.w13), tuple(packed(w, linear) for w in self.w2)
        if any(w is None for w in (*w13, *w2)):
            return
        self.packed = (w13, w2)
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)

    def packed_weights(self) -> list[PanelWeight | PackedWeight]:
        return [w for weights in self.packed or () for w in weights]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        weights, ids = self.route(x, batch.lora)
        plan = ExpertPlan.build(ids, self.moe.num_experts)
        pairs = self._pair_lora(plan, batch.lora)
        if self.packed is not None:
            gemm, (w13, w2) = moe_gemm_packed, self.packed
        else:
            gemm, w13, w2 = moe_gemm_triton if batch.kernels else moe_gemm, self.w13, self.w2
        if pairs is None:  # the gate/up matmul gathers each pair's token as it reads it
            h = gemm(x, w13, plan, gather=True)  # [pairs, 2 * inter]
        else:  # LoRA reads the pairs' tokens too: gathered once for both
            x_pairs = x[plan.tokens]  # [pairs, hidden]
            h = gemm(x_pairs, w13, plan, gather=False)  # [pairs, 2 * inter]
            inter = h.shape[1] // 2
            add_lora(
                h, x_pairs, pairs, self.pool, self.unit, self.gate_up_target, (inter, inter), self.column
            )
        gate, up = h.chunk(2, dim=-1)  # [pairs, inter] each
        act = F.silu(gate) * up
        y = gemm(act, w2, plan, gather=False)  # [pairs, hidden]
        if pairs is not None:
            add_lora(y, act, pairs, self.pool, self.unit, self.down_target, (y.shape[1],), self.row)
        out = combine(y, plan, weights)  # [tokens, hidden]
        if self.moe.shared_intermediate_size:
            out = out + self._shared_expert(x, batch.lora)
        return self.parallel.all_reduce(out)

    def _shared_expert(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        gate, up = self.shared_gate_up_proj(x, lora).chunk(2, dim=-1)  # [tokens, shared] each
        shared = self.shared_down_proj(F.silu(gate) * up, lora)  # [tokens, hidden]
        return torch.sigmoid(self.shared_expert_gate(x, lora)) * shared  # gate: [tokens, 1]

    def _pair_lora(self, plan: ExpertPlan, lora: LoraBatch | None) -> LoraBatch | None:
        if lora is None:
            return None
        experts = [e for e, count in enumerate(plan.counts) for _ in range(count)]  # of each sorted pair
        return lora.for_experts(plan.tokens.tolist(), experts, self.shifts)


def expert_weight_bytes(module: nn.Module) -> int:
    """Bytes the experts of every sparse MLP under `module` hold (their routers are LoRALinears)."""
    return sum(
        p.numel() * p.element_size()
        for m in module.modules()
        if isinstance(m, SparseMoe)
        for p in m.parameters(recurse=False)
    )

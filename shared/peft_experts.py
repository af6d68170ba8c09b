"""The mixture-of-experts parts of a PEFT checkpoint: LoRA on a layer's router and on its stacked
experts, as PEFT's `target_parameters` saves it for transformers 5's MoE models, turned into
per-expert LoRA in the kernels' layout.

PEFT wraps each targeted parameter in a ParamWrapper; two on one module nest, the parameter
registered later outermost: with both of the experts' parameters targeted, "experts.lora_A" is
down_proj's and "experts.base_layer.lora_A" gate_up_proj's. For a parameter [E, out, in], lora_A
is [r*E, in] (expert e's rows e*r .. e*r + r - 1) and lora_B [out, r*E] (expert e's columns
e, E + e, 2E + e, ...: the expert index varies fastest), so expert e's weight gains
scaling * B_e @ A_e. gate_up_proj holds each expert's gate rows then its up rows: its LoRA becomes
a gate and an up target with the same A. The router's weight [E, hidden] is a plain matrix: its
LoRA is an ordinary one, lora_A [r, hidden] and lora_B [E, r].
"""

import re

import torch

from shared.errors import FailedPrecondition, InvalidArgument
from shared.model_config import ModelConfig

# What LoRA may target on a mixture-of-experts layer, by the parameter's name below the layer;
# the experts' two in the order transformers registers them (their wrappers' nesting order).
PARAM_KEYS = {
    "router": "mlp.gate.weight",
    "experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "experts.down_proj": "mlp.experts.down_proj",
}
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
MOE_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.(experts(?:\.base_layer)*|gate)\.lora_(A|B)\.weight"
)


def targeted_params(target_parameters: tuple[str, ...], where: str) -> tuple[str, ...]:
    """Which of the router and the experts' parameters `target_parameters` names (PEFT matches a
    name against the end of each parameter's); a name matching none of them is refused."""
    found = set()
    for target in target_parameters:
        hits = {p for p, key in PARAM_KEYS.items() if f"model.layers.N.{key}".endswith("." + target)}
        if not hits:
            raise FailedPrecondition(
                f"{where}: target_parameters names {target!r}, which is no parameter LoRA can target here "
                f"(a mixture-of-experts layer's {', '.join(PARAM_KEYS.values())})"
            )
        found |= hits
    return tuple(p for p in PARAM_KEYS if p in found)


def param_of(module_path: str, targeted: tuple[str, ...], key: str, where: str) -> str:
    """The parameter a tensor's wrapper adapts ("router", "experts.gate_up_proj" or
    "experts.down_proj"): for the experts, the one its nesting depth names, the outermost wrapper
    being the last targeted one."""
    if module_path == "gate":
        if "router" not in targeted:
            raise InvalidArgument(
                f"{where}: tensor {key} adapts the router, which target_parameters does not name"
            )
        return "router"
    experts = [p for p in EXPERT_PARAMS if p in targeted]
    depth = module_path.count(".base_layer")
    if depth >= len(experts):
        raise InvalidArgument(
            f"{where}: tensor {key} is nested {depth} wrappers deep, but target_parameters names "
            f"{len(experts)} of the experts' parameters ({', '.join(experts) or 'none'})"
        )
    return experts[len(experts) - 1 - depth]


def module_key(layer: int, param: str) -> str:
    """The name PEFT matches rank_pattern and alpha_pattern against."""
    return f"model.layers.{layer}.{PARAM_KEYS[param]}"


def per_expert(
    param: str, a: torch.Tensor, b: torch.Tensor, rank: int, model: ModelConfig, label: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A parameter's PEFT lora_A and lora_B as target -> (A [E, r, in], B [E, out, r]) per expert
    (the router: target "router" -> (A [r, in], B [E, r]))."""
    moe, hidden = model.moe, model.hidden_size
    inter, experts = moe.intermediate_size, moe.num_experts
    shapes = {"router": (hidden, experts, 1), "experts.gate_up_proj": (hidden, 2 * inter, experts)}
    in_features, out_features, stacked = shapes.get(param, (inter, hidden, experts))
    want_a, want_b = (rank * stacked, in_features), (out_features, rank * stacked)
    for half, got, want in (("lora_A", a, want_a), ("lora_B", b, want_b)):
        if tuple(got.shape) != want:
            per = f"rank {rank} times {experts} experts" if stacked > 1 else f"rank {rank}"
            raise InvalidArgument(
                f"{label}.{half} has shape {tuple(got.shape)}, expected {list(want)} ({per})"
            )
    if param == "router":
        return {"router": (a, b)}
    a_e = a.reshape(experts, rank, in_features)  # [E, r, in]
    b_e = b.reshape(out_features, rank, experts).permute(2, 0, 1)  # [E, out, r]
    if param == "experts.down_proj":
        return {"down_proj": (a_e, b_e)}
    return {"gate_proj": (a_e, b_e[:, :inter]), "up_proj": (a_e, b_e[:, inter:])}

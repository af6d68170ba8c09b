"""The mixture-of-experts parts of a PEFT checkpoint: LoRA on a layer's router and on its experts,
turned into per-expert LoRA in the kernels' layout. Each part is named by its path below the
layer ("mlp.experts.gate_up_proj"), which is also what rank_pattern and alpha_pattern match.

transformers 5 stacks the experts into two parameters, gate_up_proj [E, 2 * inter, hidden] and
down_proj [E, hidden, inter], and PEFT adapts them through `target_parameters`: each targeted
parameter gets a ParamWrapper, and two on one module nest, the parameter registered later
outermost (with both targeted, "experts.lora_A" is down_proj's and "experts.base_layer.lora_A"
gate_up_proj's). For a parameter [E, out, in], lora_A is [r*E, in] (expert e's rows e*r ..
e*r + r - 1) and lora_B [out, r*E] (expert e's columns e, E + e, 2E + e, ...: the expert index
varies fastest), so expert e's weight gains scaling * B_e @ A_e. gate_up_proj holds each expert's
gate rows then its up rows: its LoRA becomes a gate and an up target with the same A.

transformers 4 held every expert as nn.Linear modules (experts.{e}.gate_proj/up_proj/down_proj;
Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2), each with its own LoRA from `target_modules`.

The router (mlp.gate, Mixtral 4's block_sparse_moe.gate) is a plain [E, hidden] matrix either way:
a "gate.weight" target parameter in 5, a "gate" module in 4.
"""

import re

import torch

from shared.errors import FailedPrecondition, InvalidArgument
from shared.model_config import ModelConfig

# transformers 5's router and experts' parameters, as target_parameters names them; the experts'
# two in the order transformers registers them (their wrappers' nesting order).
PARAMETERS = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EXPERT_PARAMETERS = PARAMETERS[1:]
MOE_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\."
    r"((?:mlp|block_sparse_moe)\.(?:experts(?:\.base_layer)*|gate|experts\.\d{1,9}\.\w+))\.lora_(A|B)\.weight"
)
PER_EXPERT = re.compile(r"(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)")
PER_EXPERT_TARGETS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
PER_EXPERT_TARGETS |= {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's


def targeted_parameters(target_parameters: tuple[str, ...], where: str) -> tuple[str, ...]:
    """Which of PARAMETERS `target_parameters` names (PEFT matches a name against the end of each
    parameter's); a name matching none of them is refused."""
    found = set()
    for target in target_parameters:
        hits = {p for p in PARAMETERS if f"model.layers.N.{p}".endswith("." + target)}
        if not hits:
            raise FailedPrecondition(
                f"{where}: target_parameters names {target!r}, which is no parameter LoRA can target here "
                f"(a mixture-of-experts layer's {', '.join(PARAMETERS)})"
            )
        found |= hits
    return tuple(p for p in PARAMETERS if p in found)


def part_of(path: str, parameters: tuple[str, ...], key: str, where: str) -> str:
    """The part a tensor at `path` below its layer adapts: a parameter of transformers 5 (the
    experts' one its wrappers' nesting depth names; the router's when target_parameters names
    it), else the module at `path` (the router, an expert's linear layer)."""
    if path.endswith(".gate") and "mlp.gate.weight" in parameters:
        return "mlp.gate.weight"
    if not path.startswith("mlp.experts") or PER_EXPERT.fullmatch(path):
        return path
    experts = [p for p in EXPERT_PARAMETERS if p in parameters]
    depth = path.count(".base_layer")
    if depth >= len(experts):
        raise InvalidArgument(
            f"{where}: tensor {key} is nested {depth} wrappers deep, but target_parameters names "
            f"{len(experts)} of the experts' parameters ({', '.join(experts) or 'none'})"
        )
    return experts[len(experts) - 1 - depth]


def expert_index(part: str) -> int | None:
    """The expert a transformers 4 expert module belongs to (None for other parts)."""
    match = PER_EXPERT.fullmatch(part)
    return int(match[2]) if match else None


def check_part(part: str, model: ModelConfig | None, key_label: str) -> None:
    """Refuse a part this model has no place for: an expert past its count, a module no expert has."""
    match = PER_EXPERT.fullmatch(part)
    if match and match[3] not in PER_EXPERT_TARGETS:
        raise InvalidArgument(f"{key_label}: an expert has no module {match[3]!r}")
    if match and model and int(match[2]) >= model.moe.num_experts:
        last = model.moe.num_experts - 1
        raise FailedPrecondition(
            f"{key_label} is for expert {match[2]}; the base model's experts are 0 to {last}"
        )


def stacked(
    part: str, a: torch.Tensor, b: torch.Tensor, rank: int, model: ModelConfig, label: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A transformers 5 parameter's PEFT lora_A and lora_B (or the router's) as target ->
    (A [E, r, in], B [E, out, r]) (the router: "router" -> (A [r, in], B [E, r]))."""
    moe, hidden = model.moe, model.hidden_size
    inter, experts = moe.intermediate_size, moe.num_experts
    shapes = {
        "mlp.experts.gate_up_proj": (hidden, 2 * inter, experts),
        "mlp.experts.down_proj": (inter, hidden, experts),
    }
    in_features, out_features, count = shapes.get(part, (hidden, experts, 1))
    want_a, want_b = (rank * count, in_features), (out_features, rank * count)
    for half, got, want in (("lora_A", a, want_a), ("lora_B", b, want_b)):
        if tuple(got.shape) != want:
            per = f"rank {rank} times {experts} experts" if count > 1 else f"rank {rank}"
            raise InvalidArgument(
                f"{label}.{half} has shape {tuple(got.shape)}, expected {list(want)} ({per})"
            )
    if count == 1:
        return {"router": (a, b)}
    a_e = a.reshape(experts, rank, in_features)  # [E, r, in]
    b_e = b.reshape(out_features, rank, experts).permute(2, 0, 1)  # [E, out, r]
    if part == "mlp.experts.down_proj":
        return {"down_proj": (a_e, b_e)}
    return {"gate_proj": (a_e, b_e[:, :inter]), "up_proj": (a_e, b_e[:, inter:])}


def per_expert_target(part: str) -> str:
    """The target a transformers 4 expert module's LoRA joins (gate_proj, up_proj or down_proj)."""
    return PER_EXPERT_TARGETS[PER_EXPERT.fullmatch(part)[3]]


def stack_experts(
    loras: dict[int, tuple[torch.Tensor, torch.Tensor]], model: ModelConfig, label: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's (A [r_e, in], B^T [r_e, out]) of one target, stacked at the largest rank
    (the rank rows past an expert's own are zeros): (A [E, r, in], B^T [E, r, out])."""
    missing = sorted(set(range(model.moe.num_experts)) - set(loras))
    if missing:
        raise InvalidArgument(f"{label}: no LoRA for expert {missing[0]}, though other experts have one")
    rank = max(a.shape[0] for a, _ in loras.values())
    some_a, some_b = next(iter(loras.values()))
    a_all = some_a.new_zeros(model.moe.num_experts, rank, some_a.shape[1])
    b_all = some_b.new_zeros(model.moe.num_experts, rank, some_b.shape[1])
    for e, (a, b_t) in loras.items():
        a_all[e, : a.shape[0]], b_all[e, : b_t.shape[0]] = a, b_t
    return a_all, b_all

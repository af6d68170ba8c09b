"""The base model's architecture, read from an HF config.json: dense Llama, Mistral and Qwen2, and
the mixture-of-experts Qwen3-MoE, Mixtral and OLMoE."""

import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import FailedPrecondition, InvalidArgument

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# LoRA target -> (packed module, slice index). q/k/v and gate/up run as one matmul each. On an
# MoE model gate/up/down are every expert's (one LoRA per expert), "router" is the router, and
# Qwen2-MoE's shared expert has its own gate/up/down and the gate of its output.
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "router": ("router", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "shared_gate_proj": ("shared_gate_up_proj", 0),
    "shared_up_proj": ("shared_gate_up_proj", 1),
    "shared_down_proj": ("shared_down_proj", 0),
    "shared_expert_gate": ("shared_expert_gate", 0),
}

# How tensor parallelism splits each target's layer (Megatron): by output rows, by input columns
# (its ranks' outputs summed), or not at all.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "shared_gate_proj", "shared_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj", "shared_down_proj")

# Where each PEFT module sits inside a decoder layer, as HF names it.
MODULE_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "router": "mlp",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "shared_gate_proj": "mlp.shared_expert",
    "shared_up_proj": "mlp.shared_expert",
    "shared_down_proj": "mlp.shared_expert",
    "shared_expert_gate": "mlp",
}


def peft_path(target: str) -> str:
    """Where PEFT finds a LoRA target's module below a decoder layer: "self_attn.q_proj",
    "mlp.shared_expert.gate_proj" (Qwen2-MoE's shared expert)."""
    parent = MODULE_PARENTS[target]
    return f"{parent}.{target.removeprefix('shared_') if parent == 'mlp.shared_expert' else target}"


DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "router", "gate_proj", "up_proj", "down_proj")
SHARED_EXPERT_TARGETS = ("shared_gate_proj", "shared_up_proj", "shared_down_proj", "shared_expert_gate")
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")  # on an MoE model


@dataclass(frozen=True)
class LinearShape:
    """One linear layer of a decoder block: its packed home and its weight shape (on a
    tensor-parallel rank, the shape of its LoRA's part there)."""

    packed: str
    slice_index: int
    in_features: int
    out_features: int
    experts: int = 1  # an MoE layer's gate/up/down: one such weight per expert
    # Blocks of B^T rank rows a LoRA page holds per block of A rows: a fully sharded column
    # layer's rank holds every rank's B rows for its outputs (their shrinks are gathered).
    gathered: int = 1


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of every decoder layer: a router picks top_k of num_experts per token
    (softmax over all experts, then the top k, renormalized to sum 1 when norm_topk_prob), and
    the token's output is the picked experts' SwiGLU MLPs weighted by those probabilities."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    # Qwen2-MoE: an MLP every token runs besides the experts, its output gated by
    # sigmoid(shared_expert_gate(x)); 0: none
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_quantization: str = "none"  # "nf4" or "int8": the folder holds pre-quantized weights
    moe: MoeConfig | None = None  # None: a dense MLP in every layer
    qk_norm: str = "none"  # "head": RMSNorm of each head's q and k (Qwen3); "full": of all of q, k (OLMoE)
    # On a tensor-parallel rank whose adapters are fully sharded (S-LoRA), the ranks they are
    # split over: linear_shapes() then gives each target's LoRA part on the rank. 1: none.
    lora_ranks: int = 1

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"config.json: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise InvalidArgument(f"model folder {model_dir} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(SUPPORTED_MODEL_TYPES)
            raise FailedPrecondition(f"config.json: model_type {model_type!r} is not supported ({supported})")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        is_qwen2 = model_type in ("qwen2", "qwen2_moe")
        eos = cfg.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_config(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("qkv_bias", True) if is_qwen2 else cfg.get("attention_bias", False),
            o_bias=not is_qwen2 and cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=_sliding_window(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            checkpoint_quantization=_checkpoint_quantization(cfg.get("quantization_config")),
            moe=_moe_config(cfg) if model_type in MOE_MODEL_TYPES else None,
            qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(model_type, "none"),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The LoRA targets, in adapter memory order (a packed module's slices consecutive): every
        linear layer of a dense model; an MoE model's attention, router and experts."""
        if self.moe and self.moe.shared_intermediate_size:
            return MOE_TARGETS + SHARED_EXPERT_TARGETS
        return MOE_TARGETS if self.moe else DENSE_TARGETS

    def first_target(self, packed: str) -> int:
        """The target index of a packed module's first slice."""
        return next(t for t, name in enumerate(self.lora_targets) if PACKED_MODULES[name][0] == packed)

    def linear_shapes(self) -> dict[str, LinearShape]:
        """LoRA target -> shape, for the linear layers LoRA may target in every block, in
        lora_targets order; an expert target's shape is one expert's."""
        h = self.hidden_size
        i = self.moe.intermediate_size if self.moe else self.intermediate_size
        experts = self.moe.num_experts if self.moe else 1
        in_out = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "router": (h, experts),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if self.moe and self.moe.shared_intermediate_size:
            shared = self.moe.shared_intermediate_size
            in_out |= {
                "shared_gate_proj": (h, shared),
                "shared_up_proj": (h, shared),
                "shared_down_proj": (shared, h),
                "shared_expert_gate": (h, 1),
            }
        n = self.lora_ranks  # fully sharded LoRA: a row layer's B split too, a column layer's B gathered
        return {
            name: LinearShape(
                *PACKED_MODULES[name],
                in_features=in_out[name][0],
                out_features=in_out[name][1] // (n if name in ROW_PARALLEL else 1),
                experts=experts if name in EXPERT_TARGETS else 1,
                gathered=n if name in COLUMN_PARALLEL else 1,
            )
            for name in self.lora_targets
        }


def _sliding_window(cfg: dict) -> int | None:
    """The window every layer's attention keeps (None: all of the context). The Qwens slide only
    with use_sliding_window, and then on some layers: Qwen2 on those from max_window_layers on,
    Qwen2-MoE on every other one below it. One window serves every layer here, so a model whose
    layers differ is refused (released Qwen checkpoints turn the window off)."""
    model_type, window, layers = cfg["model_type"], cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        return None
    if window is None:
        return None
    first = cfg.get("max_window_layers", 28)
    kinds = set(cfg.get("layer_types") or [])
    if model_type == "qwen2":
        kinds = {"sliding" if i >= first else "full" for i in range(layers)}
    elif model_type == "qwen2_moe":
        kinds = {"sliding" if (i + 1) % 2 and i < first else "full" for i in range(layers)}
    if len(kinds) > 1:
        raise FailedPrecondition(
            "config.json: a sliding window on some layers only (use_sliding_window with max_window_layers, "
            "or mixed layer_types) is not supported"
        )
    return None if kinds == {"full"} or kinds == {"full_attention"} else window


def _moe_config(cfg: dict) -> MoeConfig:
    """Qwen2-MoE, Qwen3-MoE and OLMoE name the expert count num_experts (transformers 5 writes
    Qwen3-MoE's as num_local_experts, as Mixtral's); the Qwens' experts are moe_intermediate_size
    wide; Mixtral always renormalizes the top k; Qwen2-MoE adds a shared expert."""
    model_type = cfg["model_type"]
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise FailedPrecondition(
            "config.json: dense MLP layers among the sparse ones (mlp_only_layers, decoder_sparse_step) "
            "are not supported"
        )
    if cfg.get("clip_qkv") is not None:
        raise FailedPrecondition("config.json: clip_qkv is not supported")
    qwen = model_type in ("qwen2_moe", "qwen3_moe")
    return MoeConfig(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"],
        norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
        if model_type == "qwen2_moe"
        else 0,
    )


def _rope_config(cfg: dict) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); older configs write rope_theta and
    # an optional rope_scaling dict.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise FailedPrecondition(
            f"config.json: rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _checkpoint_quantization(spec: dict | None) -> str:
    """What a pre-quantized checkpoint holds: "none" for a dense one, "nf4" for bitsandbytes 4-bit
    NF4 and "int8" for torchao's per-row int8 weight-only, as transformers saves them; any other
    method is refused by name."""
    if not spec:
        return "none"
    method = spec.get("quant_method")
    if method == "bitsandbytes" and spec.get("load_in_4bit") and spec.get("bnb_4bit_quant_type") == "nf4":
        return "nf4"
    if method == "torchao" and _is_torchao_int8_per_row(spec.get("quant_type")):
        return "int8"
    if method == "bitsandbytes":
        kind = f"bitsandbytes ({'8-bit' if spec.get('load_in_8bit') else spec.get('bnb_4bit_quant_type')})"
    elif method == "torchao":
        kind = f"torchao ({_torchao_kind(spec.get('quant_type'))})"
    else:
        kind = repr(method)
    raise FailedPrecondition(
        f"config.json: quantization_config {kind} is not supported: loramux reads dense checkpoints "
        "(quantized as they load with --quantization int8 or nf4), bitsandbytes 4-bit NF4 ones and "
        "torchao Int8WeightOnlyConfig (per row) ones"
    )


def _is_torchao_int8_per_row(quant_type) -> bool:
    """transformers' serialized TorchAoConfig: one config for every module, Int8WeightOnlyConfig
    with a scale per row (PerRow granularity, no groups)."""
    if not isinstance(quant_type, dict) or set(quant_type) != {"default"}:
        return False
    config = quant_type["default"]
    data = config.get("_data", {}) if isinstance(config, dict) else {}
    granularity = data.get("granularity")
    return (
        _torchao_kind(quant_type) == "Int8WeightOnlyConfig"
        and data.get("group_size") is None
        and (granularity is None or granularity.get("_type") == "PerRow")
    )


def _torchao_kind(quant_type) -> str:
    if isinstance(quant_type, dict) and isinstance(quant_type.get("default"), dict):
        return str(quant_type["default"].get("_type"))
    return repr(quant_type)

"""Read a PEFT LoRA checkpoint folder, refuse what we cannot serve exactly, and return its
weights ready to serve: per (layer, module) A and B with the scaling merged into B."""

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from shared import peft_experts, peft_vocab
from shared.adapter_weights import AdapterWeights, ModuleLora, VocabWeights
from shared.base_vocab import BaseVocab
from shared.config_patterns import fullmatches
from shared.errors import FailedPrecondition, InvalidArgument
from shared.model_config import DENSE_TARGETS, EXPERT_TARGETS, MODULE_PARENTS, ModelConfig, peft_path
from shared.nonfinite import first_nonfinite

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.ckpt")
CHECKPOINT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A linear module's path below its layer -> its LoRA target (the router is no nn.Linear module).
PEFT_TARGETS = {peft_path(t): t for t in MODULE_PARENTS if t != "router"}
TENSOR_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp|mlp\.shared_expert)\.(\w+)\.lora_(A|B)\.weight"
)


@dataclass(frozen=True)
class LoraConfig:
    """The parts of adapter_config.json that decide the math."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    rank_pattern: dict
    alpha_pattern: dict
    target_parameters: tuple[str, ...] = ()  # an MoE layer's router and experts (peft_experts.py)
    modules_to_save: tuple[str, ...] = ()  # "embed_tokens", "lm_head": served from the adapter's own copy
    trainable_tokens: dict[str, tuple[int, ...]] = field(
        default_factory=dict
    )  # module -> re-trained rows' token ids
    # On a tied model: LoRA or a copy on the embedding or the head is on both (PEFT saves both).
    ensure_weight_tying: bool = False
    # Each regex above -> the module names it matches whole (with_matches; config_patterns.py).
    matches: dict[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, cfg: dict, where: str) -> "LoraConfig":
        _refuse_unsupported(cfg, where)
        rank, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
        if not isinstance(rank, int) or rank <= 0:
            raise InvalidArgument(f"{where}: r must be a positive integer, got {rank!r}")
        if not isinstance(alpha, int | float):
            raise InvalidArgument(f"{where}: lora_alpha must be a number, got {alpha!r}")
        targets, parameters = cfg.get("target_modules") or (), cfg.get("target_parameters") or []
        if not isinstance(targets, str | list | tuple) or not isinstance(parameters, list):
            raise InvalidArgument(
                f"{where}: target_modules must be a list, a regex or 'all-linear', target_parameters a list"
            )
        saved, tokens = _modules_to_save(cfg, where), _trainable_tokens(cfg, where)
        if not targets and not parameters and not saved and not tokens:
            raise InvalidArgument(
                f"{where}: target_modules, target_parameters, modules_to_save and trainable_token_indices "
                "name nothing to adapt"
            )
        return cls(
            rank,
            float(alpha),
            bool(cfg.get("use_rslora", False)),
            targets if isinstance(targets, str) else tuple(targets),
            _patterns(cfg, "rank_pattern", _is_rank, "positive integers", where),
            _patterns(cfg, "alpha_pattern", _is_number, "numbers", where),
            tuple(parameters),
            saved,
            tokens,
            bool(cfg.get("ensure_weight_tying", False)),
        )

    def with_matches(self, names: list[str], where: str) -> "LoraConfig":
        """This config with its regexes matched against `names`: every module name it is asked about."""
        regexes = {_ending(p) for p in [*self.rank_pattern, *self.alpha_pattern]}
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            regexes.add(self.target_modules)
        return replace(self, matches=fullmatches(regexes, names, where))

    def scaling(self, module_key: str, rank: int) -> float:
        alpha = self._pattern_value(self.alpha_pattern, module_key, self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def expected_rank(self, module_key: str) -> int:
        return self._pattern_value(self.rank_pattern, module_key, self.rank)

    def _pattern_value(self, patterns: dict, module_key: str, default):
        """The value of the first pattern whose key matches the end of the module name, as PEFT
        reads rank_pattern and alpha_pattern."""
        for pattern, value in patterns.items():
            if module_key in self.matches[_ending(pattern)]:
                return value
        return default


def load_peft_adapter(
    name: str,
    adapter_dir: str | Path,
    model: ModelConfig | None,
    max_rank: int | None,
    dtype: torch.dtype,
    base: BaseVocab | None = None,
) -> AdapterWeights:
    """Validate the checkpoint in `adapter_dir` against `model` (shapes, modules) and return
    its weights in `dtype`. `base`: the base model's weights, which the copies PEFT saves of a
    LoRA-targeted embedding or head must equal. Every refusal names adapter, file, module and
    shapes."""
    adapter_dir = Path(adapter_dir)
    where = f"adapter {name!r}"
    config = LoraConfig.from_json(_read_config(adapter_dir, where), f"{where}: {CONFIG_FILE}")
    vocab_tensors, tensors = peft_vocab.split(_read_tensors(adapter_dir, where))
    pairs = _pair_tensors(tensors, peft_experts.targeted_parameters(config.target_parameters, where), where)
    names = _module_names(model, pairs)
    config = config.with_matches(names + [_module_key(*key) for key in pairs], where)
    vocab_targets = _check_targets(config, pairs, names, model, where)
    _check_values(pairs, where)
    loading = Loading(config, model, max_rank, dtype, where)
    modules = _layer_modules(loading, pairs)
    vocab = peft_vocab.read(vocab_tensors, vocab_targets, loading, base)
    if not modules and not vocab:
        raise InvalidArgument(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    _check_serving_values(modules, vocab, dtype, where)
    ranks = [m.rank for m in modules.values()] + [
        lora.rank for lora in (vocab.embed_lora, vocab.head_lora) if lora
    ]
    return AdapterWeights(
        rank=max(ranks, default=config.rank),
        alpha=config.alpha,
        target_modules=tuple(sorted({module for _, module in modules})) + vocab.lora_targets,
        modules=modules,
        vocab=vocab,
    )


def _layer_modules(loading: "Loading", pairs: dict) -> dict[tuple[int, str], ModuleLora]:
    """The decoder layers' LoRA, (layer, target) -> weights, an MoE layer's experts stacked."""
    modules, experts = {}, {}  # experts: (layer, target) -> expert -> a transformers 4 expert's LoRA
    for (layer, module), (a, b) in pairs.items():
        if peft_experts.expert_index(module) is not None:
            target = peft_experts.per_expert_target(module)
            lora = _module(loading, (layer, module), a, b, target)
            experts.setdefault((layer, target), {})[peft_experts.expert_index(module)] = (lora.a, lora.b_t)
        elif "." in module:
            modules |= _moe_modules(loading, (layer, module), a, b)
        else:
            modules[(layer, module)] = _module(loading, (layer, module), a, b)
    for (layer, target), loras in experts.items():
        label = f"{loading.where}: layers.{layer}'s experts' {target}"
        modules[(layer, target)] = ModuleLora(*peft_experts.stack_experts(loras, loading.model, label))
    return modules


def _refuse_unsupported(cfg: dict, where: str) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"{where}: peft_type {cfg['peft_type']!r} is not LORA")
    refusals = {
        "use_dora": "DoRA adapters (use_dora) are not supported",
        "fan_in_fan_out": "fan_in_fan_out weights are not supported",
        "lora_bias": "a bias on lora_B (lora_bias) is not supported",
        "layer_replication": "layer_replication is not supported",
    }
    for key, why in refusals.items():
        if cfg.get(key):
            raise InvalidArgument(f"{where}: {why}")
    if cfg.get("bias", "none") != "none":
        raise InvalidArgument(
            f"{where}: bias={cfg['bias']!r} trains base biases; only bias='none' is supported"
        )


def _modules_to_save(cfg: dict, where: str) -> tuple[str, ...]:
    """The vocabulary-side modules modules_to_save names; any other module is refused by name."""
    names = cfg.get("modules_to_save") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidArgument(f"{where}: modules_to_save must be a list of module names, got {names!r}")
    modules = []
    for name in names:
        module = peft_vocab.module_of(name)
        if module is None:
            raise InvalidArgument(
                f"{where}: modules_to_save names {name!r}; an adapter's own copy is served for "
                "embed_tokens and lm_head only"
            )
        modules.append(module)
    return tuple(dict.fromkeys(modules))


def _trainable_tokens(cfg: dict, where: str) -> dict[str, tuple[int, ...]]:
    """trainable_token_indices as module -> token ids: a list re-trains embed_tokens' rows, a dict
    names the module of each list."""
    spec = cfg.get("trainable_token_indices")
    if spec is None:
        return {}
    by_module = spec if isinstance(spec, dict) else {"embed_tokens": spec}
    tokens = {}
    for name, indices in by_module.items():
        module = peft_vocab.module_of(name) if isinstance(name, str) else None
        if module is None:
            raise InvalidArgument(
                f"{where}: trainable_token_indices names {name!r}; rows of embed_tokens and lm_head "
                "are served"
            )
        if not isinstance(indices, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in indices
        ):
            raise InvalidArgument(f"{where}: trainable_token_indices of {name} must be a list of token ids")
        tokens[module] = tuple(indices)
    return tokens


def _read_config(adapter_dir: Path, where: str) -> dict:
    if not adapter_dir.is_dir():
        raise InvalidArgument(f"{where}: {adapter_dir} is not a folder")
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise InvalidArgument(f"{where}: {adapter_dir} has no {CONFIG_FILE}")
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # nested past the reader's limit
        raise InvalidArgument(f"{where}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise InvalidArgument(f"{where}: {CONFIG_FILE} must hold a JSON object")
    return cfg


def _read_tensors(adapter_dir: Path, where: str) -> dict[str, torch.Tensor]:
    if (adapter_dir / peft_vocab.NEW_EMBEDDINGS_FILE).exists():
        raise peft_vocab.resized_layout_refusal(where)
    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        pickles = [p for p in PICKLE_FILES if (adapter_dir / p).exists()]
        if pickles:
            raise pickle_refusal(where, pickles[0])
        raise InvalidArgument(f"{where}: {adapter_dir} has no {WEIGHTS_FILE}")
    try:
        with safe_open(path, framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a mapping
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise InvalidArgument(f"{where}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None


def pickle_refusal(where: str, file_name: str) -> InvalidArgument:
    """The error for a checkpoint that only comes as a pickle; the file is never unpickled."""
    return InvalidArgument(
        f"{where}: {file_name} is a pickle checkpoint, refused because loading it can run "
        f"arbitrary code; save the adapter with safetensors ({WEIGHTS_FILE})"
    )


def _pair_tensors(
    tensors: dict[str, torch.Tensor], parameters: tuple[str, ...], where: str
) -> dict[tuple[int, str], tuple]:
    """(layer, module) -> (lora_A, lora_B), every key accounted for; an MoE layer's parts as
    (layer, their path below the layer) (peft_experts.py), `parameters` being the ones
    target_parameters names."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if moe := peft_experts.MOE_KEY.fullmatch(key):
            part = peft_experts.part_of(moe[2], parameters, key, where)
            halves.setdefault((int(moe[1]), part), {})[moe[3]] = tensor
            continue
        m = TENSOR_KEY.fullmatch(key)
        target = PEFT_TARGETS.get(f"{m[2]}.{m[3]}") if m else None
        if target is None:
            raise InvalidArgument(
                f"{where}: tensor {key} is not a LoRA A/B matrix of a decoder linear layer "
                f"(DoRA vectors and other modules' weights are not supported)"
            )
        halves.setdefault((int(m[1]), target), {})[m[4]] = tensor
    for (layer, module), pair in halves.items():
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise InvalidArgument(f"{where}: layers.{layer}.{module} has no {missing} weight")
    return {key: (pair["A"], pair["B"]) for key, pair in sorted(halves.items())}


def _module_names(model: ModelConfig | None, pairs: dict) -> list[str]:
    """The names target_modules may name: every linear module of the model (of the layers the
    weights are for, without a model), and the embedding and the head."""
    layers = range(model.num_layers) if model else sorted({layer for layer, _ in pairs})
    names = [_module_key(layer, module) for layer in layers for module in _linear_modules(model)]
    return names + list(peft_vocab.MODULE_PATHS.values())


def _check_targets(
    config: LoraConfig, pairs: dict, names: list[str], model: ModelConfig | None, where: str
) -> set[str]:
    """Refuse weights target_modules does not name; the vocabulary-side modules it names."""
    modules = _linear_modules(model)
    targeted = set(_targeted(config, names, model, where)) if config.target_modules else set()
    for layer, module in pairs:
        if model and layer >= model.num_layers:
            raise FailedPrecondition(
                f"{where}: weights for layer {layer}, the base model has {model.num_layers}"
            )
        if "." in module:  # a part of an MoE layer
            label = f"{where}: layers.{layer}.{module}"
            if model is None:
                raise FailedPrecondition(f"{label}: LoRA on experts needs a base model to be checked against")
            if not model.moe:
                raise FailedPrecondition(
                    f"{label} adapts experts, but the base model ({model.model_type}) has none"
                )
            peft_experts.check_part(module, model, label)
            if module in peft_experts.PARAMETERS:
                continue  # target_parameters named it (_pair_tensors)
        elif module not in modules:
            raise FailedPrecondition(
                f"{where}: weights for layers.{layer}.{module}, but the base model's MLP is a mixture of "
                f"experts ({model.model_type}): LoRA on it targets the router and the experts"
            )
        if _module_key(layer, module) not in targeted:
            raise InvalidArgument(
                f"{where}: weights for layers.{layer}.{module}, which target_modules does not name"
            )
    return {m for m, path in peft_vocab.MODULE_PATHS.items() if path in targeted}


def _linear_modules(model: ModelConfig | None) -> tuple[str, ...]:
    """The nn.Linear modules LoRA may target by name, as paths below a layer for an MoE model's
    router and experts (the modules transformers 4 had; 5 made them parameters)."""
    if not (model and model.moe):
        return tuple(m for m in MODULE_PARENTS if m in DENSE_TARGETS)
    linear = tuple(m for m in model.lora_targets if m not in ("router", *EXPERT_TARGETS))
    parent, names = (
        ("block_sparse_moe", ("w1", "w3", "w2")) if model.model_type == "mixtral" else ("mlp", EXPERT_TARGETS)
    )
    experts = tuple(f"{parent}.experts.{e}.{n}" for e in range(model.moe.num_experts) for n in names)
    return (*linear, f"{parent}.gate", *experts)


def _targeted(config: LoraConfig, names: list[str], model: ModelConfig | None, where: str) -> list[str]:
    targets = config.target_modules
    if targets == "all-linear":  # as PEFT reads it: every linear layer but the output head
        return [n for n in names if n not in peft_vocab.MODULE_PATHS.values()]
    if isinstance(targets, str):
        found = [n for n in names if n in config.matches[targets]]
        if not found:
            raise FailedPrecondition(
                f"{where}: target_modules regex {targets!r} matches no module of the base model"
            )
        return found
    found = []
    for target in targets:
        hits = [n for n in names if n == target or n.endswith("." + target)]
        if not hits:
            raise FailedPrecondition(f"{where}: {_unknown_target(target, model)}")
        found += hits
    return found


def _unknown_target(target: str, model: ModelConfig | None) -> str:
    modules = _linear_modules(model)
    if model and model.moe:  # attention, then one expert's modules stand for every expert's
        per_expert = [m for m in modules if ".experts." in m]
        named = [m if "." in m or MODULE_PARENTS[m] == "self_attn" else peft_path(m) for m in modules]
        shown = [m for m in named if ".experts." not in m] + [
            m.replace(".0.", ".<e>.") for m in per_expert[:3]
        ]
        return (
            f"target module {target!r} is not in the base model (LoRA target modules: {', '.join(shown)}; "
            f"target_parameters: {', '.join(peft_experts.PARAMETERS)})"
        )
    return f"target module {target!r} is not in the base model (LoRA targets: {', '.join(modules)})"


@dataclass(frozen=True)
class Loading:
    """What turning one checkpoint's tensors into served LoRA needs: its config, the model it is
    checked against, the rank bound, the serving dtype, and the adapter's name for messages."""

    config: LoraConfig
    model: ModelConfig | None
    max_rank: int | None
    dtype: torch.dtype
    where: str

    def check_rank(self, label: str, rank: int) -> None:
        if self.max_rank is not None and rank > self.max_rank:
            raise InvalidArgument(
                f"{label} has rank {rank}, above this server's max_lora_rank {self.max_rank}"
            )

    def served(self, a: torch.Tensor, b: torch.Tensor, scaling: float) -> ModuleLora:
        """a [..., rank, in], b [..., out, rank] -> ModuleLora in the serving dtype, scaling merged
        into B^T (A copied: gate and up of an MoE layer's experts start from the same A)."""
        b_scaled = b.float() * scaling  # [..., out, rank]
        return ModuleLora(
            a=a.to(self.dtype, copy=True).contiguous(),
            b_t=b_scaled.transpose(-1, -2).to(self.dtype).contiguous(),
        )


def _module(
    loading: Loading, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor, target: str | None = None
) -> ModuleLora:
    """A linear module's LoRA (`target`: the LoRA target whose shape it has, when its path is
    not that target's name: a transformers 4 expert's)."""
    layer, module = key
    config, model = loading.config, loading.model
    label = f"{loading.where}: layers.{layer}.{module}"
    module_key = _module_key(layer, module)
    rank = a.shape[0]
    _check_shapes(label, a, b, model.linear_shapes()[target or module] if model else None)
    if rank != config.expected_rank(module_key):
        raise InvalidArgument(
            f"{label}.lora_A has rank {rank}, {CONFIG_FILE} says r={config.expected_rank(module_key)}"
        )
    loading.check_rank(label, rank)
    return loading.served(a, b, config.scaling(module_key, rank))


def _moe_modules(
    loading: Loading, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor
) -> dict[tuple[int, str], ModuleLora]:
    """An MoE layer's router, or a parameter of its stacked experts: its targets' LoRA, per
    expert for experts."""
    layer, part = key
    label = f"{loading.where}: layers.{layer}.{part}"
    module_key = _module_key(layer, part)
    rank = loading.config.expected_rank(module_key)
    loading.check_rank(label, rank)
    scaling = loading.config.scaling(module_key, rank)
    return {
        (layer, target): loading.served(a_t, b_t, scaling)
        for target, (a_t, b_t) in peft_experts.stacked(part, a, b, rank, loading.model, label).items()
    }


def _check_values(pairs: dict[tuple[int, str], tuple], where: str) -> None:
    """Every half a float matrix holding no NaN or Inf (checked for all halves at once)."""
    halves = {}
    for (layer, module), (a, b) in pairs.items():
        for half, t in (("lora_A", a), ("lora_B", b)):
            label = f"layers.{layer}.{module}.{half}"
            if t.dtype not in CHECKPOINT_DTYPES:
                raise InvalidArgument(
                    f"{where}: {label} has dtype {t.dtype}; float16, bfloat16 or float32 expected"
                )
            if t.dim() != 2:
                raise InvalidArgument(f"{where}: {label} has shape {tuple(t.shape)}, a matrix expected")
            halves[label] = t
    bad = first_nonfinite(halves)
    if bad is not None:
        raise InvalidArgument(f"{where}: {bad} contains NaN or Inf values")


def _check_serving_values(
    modules: dict[tuple[int, str], ModuleLora], vocab: VocabWeights, dtype: torch.dtype, where: str
) -> None:
    """Finite weights can still overflow once B is scaled or cast to a narrower serving dtype;
    refused here, they would otherwise turn every request's logits to NaN."""
    halves = dict(vocab.tensors)
    for (layer, module), m in modules.items():
        halves[f"layers.{layer}.{module}.lora_A"], halves[f"layers.{layer}.{module}.lora_B"] = m.a, m.b_t
    bad = first_nonfinite(halves)
    if bad is not None:
        raise InvalidArgument(
            f"{where}: {bad} overflows {str(dtype).removeprefix('torch.')} once scaled (lora_alpha "
            "over the rank) and cast to this server's dtype"
        )


def _check_shapes(label: str, a: torch.Tensor, b: torch.Tensor, shape) -> None:
    if b.shape[1] != a.shape[0]:
        raise InvalidArgument(
            f"{label}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} disagree on the rank"
        )
    if shape is None:
        return
    if a.shape[1] != shape.in_features:
        raise InvalidArgument(
            f"{label}.lora_A has shape {tuple(a.shape)}, the base layer takes "
            f"{shape.in_features} inputs (expected [{a.shape[0]}, {shape.in_features}])"
        )
    if b.shape[0] != shape.out_features:
        raise InvalidArgument(
            f"{label}.lora_B has shape {tuple(b.shape)}, the base layer gives "
            f"{shape.out_features} outputs (expected [{shape.out_features}, {b.shape[1]}])"
        )


def _module_key(layer: int, module: str) -> str:
    """The name PEFT matches target_modules, rank_pattern and alpha_pattern against (an MoE
    layer's parts are named by their path below the layer)."""
    if "." in module:
        return f"model.layers.{layer}.{module}"
    return f"model.layers.{layer}.{peft_path(module)}"


def _ending(pattern: str) -> str:
    """A rank_pattern or alpha_pattern key as a regex of the whole module name: PEFT matches the
    key against the name's end."""
    return rf"(.*\.)?{pattern}"


def _patterns(cfg: dict, field_name: str, valid, what: str, where: str) -> dict:
    patterns = cfg.get(field_name) or {}
    if not isinstance(patterns, dict) or not all(
        isinstance(k, str) and valid(v) for k, v in patterns.items()
    ):
        raise InvalidArgument(f"{where}: {field_name} must map module names or regexes to {what}")
    return dict(patterns)


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)

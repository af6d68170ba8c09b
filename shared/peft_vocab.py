"""The vocabulary side of a PEFT checkpoint: LoRA on embed_tokens and lm_head, their own copies
(modules_to_save), re-trained token rows (trainable_token_indices), and the base-layer copies
PEFT saves beside LoRA on them. Everything is checked against the base model: its vocabulary
(resized vocabularies are refused), its hidden size and, for saved base-layer copies, its weights."""

import re
from typing import TYPE_CHECKING

import torch

from shared.adapter_weights import ModuleLora, TokenRows, VocabWeights
from shared.base_vocab import BaseVocab
from shared.errors import FailedPrecondition, InvalidArgument
from shared.model_config import ModelConfig
from shared.nonfinite import first_nonfinite

if TYPE_CHECKING:
    from shared.peft_checkpoint import Loading

# PEFT's path of each vocabulary-side module, the name its keys and target_modules use.
MODULE_PATHS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
VOCAB_KEY = re.compile(r"(?:base_model\.model\.)?(model\.embed_tokens|lm_head)\.(.+)")
# The tensors PEFT saves under each module: LoRA's halves, the base layer's copy, the adapter's
# own copy (modules_to_save) and the re-trained rows (trainable tokens).
LORA_HALVES = {
    "embed_tokens": ("lora_embedding_A", "lora_embedding_B"),
    "lm_head": ("lora_A.weight", "lora_B.weight"),
}
BASE_COPY, OWN_COPY, TOKEN_DELTA = "base_layer.weight", "weight", "token_adapter.trainable_tokens_delta"
NEW_EMBEDDINGS_FILE = "new_embeddings.safetensors"  # PEFT's old layout for added tokens
RESIZED_ADVICE = (
    "adapters that resize the vocabulary are not served; re-train existing rows with "
    "trainable_token_indices instead"
)


def module_of(path: str) -> str | None:
    """The vocabulary-side module a target_modules or modules_to_save entry names, if any."""
    return next((m for m, p in MODULE_PATHS.items() if path in (m, p) or p.endswith("." + path)), None)


def split(tensors: dict[str, torch.Tensor]) -> tuple[dict[tuple[str, str], torch.Tensor], dict]:
    """(module, what) -> tensor for the vocabulary side's keys; the other tensors, untouched."""
    vocab, rest = {}, {}
    for key, tensor in tensors.items():
        if m := VOCAB_KEY.fullmatch(key):
            vocab[module_of(m[1]), m[2]] = tensor
        else:
            rest[key] = tensor
    return vocab, rest


def resized_layout_refusal(where: str) -> InvalidArgument:
    return InvalidArgument(
        f"{where}: {NEW_EMBEDDINGS_FILE} holds embeddings of tokens added to the vocabulary; {RESIZED_ADVICE}"
    )


def read(
    tensors: dict[tuple[str, str], torch.Tensor],
    lora_targets: set[str],
    loading: "Loading",
    base: BaseVocab | None,
) -> VocabWeights:
    """The vocabulary-side parts in the serving dtype; `lora_targets`: the vocabulary-side modules
    target_modules names. Every refusal names the tensor."""
    config, model, where = loading.config, loading.model, loading.where
    _check_keys(tensors, where)
    if tensors and model is None:
        raise FailedPrecondition(
            f"{where}: weights of embed_tokens or lm_head need a base model to be checked against"
        )
    _check_values(tensors, where)
    tied = model.tie_word_embeddings if model else False
    saved = set(config.modules_to_save)
    if tied and config.ensure_weight_tying:  # PEFT adapts the tied pair together
        lora_targets = set(MODULE_PATHS) if lora_targets else lora_targets
        saved = set(MODULE_PATHS) if saved else saved
    for module in MODULE_PATHS:
        _check_declared(tensors, module, lora_targets, saved, config, where)
        for what, tensor in tensors.items():
            if what[0] == module:
                _check_shape(module, what[1], tensor, model, where)
        if (module, BASE_COPY) in tensors:
            _check_base_copy(module, tensors[module, BASE_COPY], base, where)
    embed_rows = _token_rows(tensors, "embed_tokens", config, loading)
    head_rows = _token_rows(tensors, "lm_head", config, loading)
    if tied and head_rows is not None:
        raise InvalidArgument(
            f"{where}: trainable tokens of lm_head on a base model whose lm_head is its embedding "
            "(tie_word_embeddings): re-train the rows of embed_tokens, which the head shares"
        )
    vocab = VocabWeights(
        embed_lora=_lora(tensors, "embed_tokens", loading),
        head_lora=_lora(tensors, "lm_head", loading),
        embed=_own(tensors, "embed_tokens", loading.dtype),
        head=_own(tensors, "lm_head", loading.dtype),
        embed_rows=embed_rows,
        head_rows=_tied_rows(embed_rows) if tied else head_rows,
    )
    _one_kind_per_side(vocab, where)
    return vocab


def _check_keys(tensors: dict, where: str) -> None:
    for module, what in tensors:
        if what not in (*LORA_HALVES[module], BASE_COPY, OWN_COPY, TOKEN_DELTA):
            raise InvalidArgument(
                f"{where}: tensor {MODULE_PATHS[module]}.{what} is none of the parts of {module} served "
                f"(LoRA's {' and '.join(LORA_HALVES[module])}, {BASE_COPY}, {OWN_COPY} of modules_to_save, "
                f"{TOKEN_DELTA})"
            )


def _check_values(tensors: dict, where: str) -> None:
    named = {f"{MODULE_PATHS[m]}.{what}": t for (m, what), t in tensors.items()}
    for name, t in named.items():
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise InvalidArgument(
                f"{where}: {name} has dtype {t.dtype}; float16, bfloat16 or float32 expected"
            )
        if t.dim() != 2:
            raise InvalidArgument(f"{where}: {name} has shape {tuple(t.shape)}, a matrix expected")
    bad = first_nonfinite(named)
    if bad is not None:
        raise InvalidArgument(f"{where}: {bad} contains NaN or Inf values")


def _check_declared(
    tensors: dict, module: str, lora_targets: set[str], saved: set[str], config, where: str
) -> None:
    """Each part present exactly when adapter_config.json declares it (`saved`: the modules
    whose own copies it declares)."""
    path = MODULE_PATHS[module]
    declared = {
        "LoRA (target_modules)": (module in lora_targets, LORA_HALVES[module]),
        "modules_to_save": (module in saved, (OWN_COPY,)),
        "trainable_token_indices": (module in config.trainable_tokens, (TOKEN_DELTA,)),
    }
    for key, (named, parts) in declared.items():
        for part in parts:
            if named and (module, part) not in tensors:
                raise InvalidArgument(f"{where}: {key} names {module}, but the weights lack {path}.{part}")
            if not named and (module, part) in tensors:
                raise InvalidArgument(f"{where}: tensor {path}.{part}, but {key} does not name {module}")
    if (module, BASE_COPY) in tensors and module not in lora_targets:
        raise InvalidArgument(
            f"{where}: tensor {path}.{BASE_COPY}, but target_modules does not name {module}"
        )


def _check_shape(module: str, what: str, tensor: torch.Tensor, model: ModelConfig, where: str) -> None:
    """Shapes against the base model; a vocabulary dimension other than the base's is a resized
    vocabulary, refused as such."""
    vocab, hidden, name = model.vocab_size, model.hidden_size, f"{MODULE_PATHS[module]}.{what}"
    shape = tuple(tensor.shape)
    vocab_dim, hidden_dim = {
        ("embed_tokens", "lora_embedding_A"): (1, None),
        ("embed_tokens", "lora_embedding_B"): (None, 0),
        ("lm_head", "lora_A.weight"): (None, 1),
        ("lm_head", "lora_B.weight"): (0, None),
    }.get((module, what), (0, 1))
    if hidden_dim is not None and shape[hidden_dim] != hidden:
        raise InvalidArgument(
            f"{where}: {name} has shape {list(shape)}; the base model's hidden size is {hidden} "
            f"(dimension {hidden_dim})"
        )
    if vocab_dim is not None and shape[vocab_dim] != vocab and what != TOKEN_DELTA:
        raise InvalidArgument(
            f"{where}: {name} has shape {list(shape)}: a vocabulary of {shape[vocab_dim]} tokens, the "
            f"base model's has {vocab}; {RESIZED_ADVICE}"
        )


def _check_base_copy(module: str, copy: torch.Tensor, base: BaseVocab | None, where: str) -> None:
    """PEFT saves the base layer of a module LoRA targets: it must be the base model's own."""
    name = f"{MODULE_PATHS[module]}.{BASE_COPY}"
    if base is None:
        raise FailedPrecondition(
            f"{where}: {name} can only be checked against the base model's weights, and none are known here"
        )
    if not torch.equal(base.weight(module).to(copy.dtype), copy):
        raise FailedPrecondition(
            f"{where}: {name} differs from the base model's {module} weights: the adapter was trained "
            "on another base model (or a resized vocabulary)"
        )


def _lora(tensors: dict, module: str, loading: "Loading") -> ModuleLora | None:
    a_key, b_key = LORA_HALVES[module]
    if (module, a_key) not in tensors:
        return None
    a, b = tensors[module, a_key], tensors[module, b_key]  # [r, in], [out, r]
    label = f"{loading.where}: {MODULE_PATHS[module]}"
    path = MODULE_PATHS[module]
    if a.shape[0] != b.shape[1]:
        raise InvalidArgument(
            f"{label}: {a_key} {list(a.shape)} and {b_key} {list(b.shape)} disagree on the rank"
        )
    rank, expected = a.shape[0], loading.config.expected_rank(path)
    if rank != expected:
        raise InvalidArgument(f"{label}.{a_key} has rank {rank}, adapter_config.json says r={expected}")
    loading.check_rank(label, rank)
    return loading.served(a, b, loading.config.scaling(path, rank))


def _own(tensors: dict, module: str, dtype: torch.dtype) -> torch.Tensor | None:
    weight = tensors.get((module, OWN_COPY))
    return None if weight is None else weight.to(dtype, copy=True).contiguous()


def _token_rows(tensors: dict, module: str, config, loading: "Loading") -> TokenRows | None:
    if module not in config.trainable_tokens:
        return None
    indices, delta = config.trainable_tokens[module], tensors[module, TOKEN_DELTA]
    name = f"{loading.where}: {MODULE_PATHS[module]}.{TOKEN_DELTA}"
    vocab = loading.model.vocab_size
    outside = [i for i in indices if not 0 <= i < vocab]
    if outside:
        raise InvalidArgument(
            f"{loading.where}: trainable_token_indices of {module} has {outside[0]}, outside the base "
            f"model's vocabulary 0..{vocab - 1}; {RESIZED_ADVICE.split('; ')[0]}"
        )
    repeated = next((i for n, i in enumerate(indices) if i in indices[:n]), None)
    if repeated is not None:
        raise InvalidArgument(
            f"{loading.where}: trainable_token_indices of {module} names token {repeated} twice"
        )
    if delta.shape[0] != len(indices):
        raise InvalidArgument(
            f"{name} has {delta.shape[0]} rows; trainable_token_indices names {len(indices)} tokens"
        )
    return TokenRows(tuple(indices), delta.to(loading.dtype, copy=True).contiguous())


def _tied_rows(embed_rows: TokenRows | None) -> TokenRows | None:
    """The head's re-trained rows on a tied model: PEFT re-trains the embedding's rows there, and
    the head, being the embedding, changes with them (a copy: the blob holds each side's rows)."""
    return embed_rows and TokenRows(embed_rows.indices, embed_rows.rows.clone())


def _one_kind_per_side(vocab: VocabWeights, where: str) -> None:
    sides = {
        "embed_tokens": {
            "LoRA": vocab.embed_lora,
            "modules_to_save": vocab.embed,
            "trainable tokens": vocab.embed_rows,
        },
        "lm_head": {
            "LoRA": vocab.head_lora,
            "modules_to_save": vocab.head,
            "trainable tokens": vocab.head_rows,
        },
    }
    for module, parts in sides.items():
        present = [kind for kind, part in parts.items() if part is not None]
        if len(present) > 1:
            raise InvalidArgument(
                f"{where}: {module} has both {present[0]} and {present[1]}; one kind of adapter on "
                f"{module} is served (the tied head counts the embedding's trainable tokens)"
            )

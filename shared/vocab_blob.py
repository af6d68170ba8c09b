"""The vocabulary side of the adapter wire format (adapter_blob.py): which tensors a blob may hold
for embed_tokens and lm_head, their shapes against the worker's model, and the weights they make.

    embed_tokens.lora_a [r, vocab], .lora_b_t [r, hidden]   LoRA on the embedding (B scaled)
    lm_head.lora_a [r, hidden], .lora_b_t [r, vocab]        LoRA on the head (B scaled)
    embed_tokens.weight, lm_head.weight [vocab, hidden]     the adapter's own (modules_to_save)
    embed_tokens.token_rows, lm_head.token_rows [k, hidden] re-trained rows; their token ids sit
                                                            in the metadata's "token_rows"
"""

import re

import torch

from shared.adapter_weights import ModuleLora, TokenRows, VocabWeights
from shared.errors import FailedPrecondition, quoted
from shared.model_config import ModelConfig

MODULES = ("embed_tokens", "lm_head")
TENSOR_NAME = re.compile(r"(embed_tokens|lm_head)\.(lora_a|lora_b_t|weight|token_rows)")


def check_token_rows(value: object, where: str) -> dict[str, tuple[int, ...]]:
    """The metadata's "token_rows": module -> distinct non-negative token ids."""
    if value is None:
        return {}
    ok = isinstance(value, dict) and all(
        m in MODULES
        and isinstance(ids, list)
        and all(type(i) is int and i >= 0 for i in ids)
        and len(set(ids)) == len(ids)
        for m, ids in value.items()
    )
    if not ok:
        raise FailedPrecondition(
            f"{where}: the blob's metadata token_rows {quoted(value)} is not a map of embed_tokens or "
            "lm_head to distinct non-negative token ids"
        )
    return {m: tuple(ids) for m, ids in value.items()}


def check_shapes(
    shapes: dict[str, tuple[int, ...]],
    targets: tuple[str, ...],
    token_rows: dict[str, tuple[int, ...]],
    model: ModelConfig | None,
    where: str,
) -> None:
    """Every vocabulary-side tensor shaped for `model` (vocabulary and hidden size), LoRA exactly
    on the modules `targets` names, re-trained rows exactly where `token_rows` names them."""
    for module in MODULES:
        lora = [f"{module}.lora_a", f"{module}.lora_b_t"]
        present = [name in shapes for name in lora]
        if len(set(present)) > 1 or any(present) != (module in targets):
            raise FailedPrecondition(
                f"{where}: {module}'s LoRA tensors {[n for n in lora if n in shapes]}; the blob's "
                f"target_modules {'name' if module in targets else 'do not name'} {module}"
            )
        if (f"{module}.token_rows" in shapes) != (module in token_rows):
            raise FailedPrecondition(
                f"{where}: tensor {module}.token_rows and the metadata's token_rows disagree on {module}"
            )
    for name, shape in shapes.items():
        want = _want(name, shapes, token_rows, model)
        if len(shape) != 2 or any(w is not None and w != d for w, d in zip(want, shape, strict=True)):
            shown = ["r" if w is None else w for w in want]
            raise FailedPrecondition(f"{where}: tensor {name} has shape {list(shape)}; {shown} expected")
        if model is not None and name.endswith("token_rows"):
            module = name.split(".")[0]
            past = [i for i in token_rows[module] if i >= model.vocab_size]
            if past:
                raise FailedPrecondition(
                    f"{where}: token_rows of {module} names token {past[0]}; the vocabulary has "
                    f"{model.vocab_size}"
                )


def _want(name: str, shapes: dict, token_rows: dict, model: ModelConfig | None) -> tuple:
    """The shape `name` must have (None: any; a rank must match its other half's)."""
    module, part = name.split(".")
    vocab, hidden = (model.vocab_size, model.hidden_size) if model else (None, None)
    rank = shapes.get(f"{module}.lora_a", (None,))[0]
    return {
        ("embed_tokens", "lora_a"): (rank, vocab),
        ("embed_tokens", "lora_b_t"): (rank, hidden),
        ("lm_head", "lora_a"): (rank, hidden),
        ("lm_head", "lora_b_t"): (rank, vocab),
        (module, "weight"): (vocab, hidden),
        (module, "token_rows"): (len(token_rows.get(module, ())), hidden),
    }[module, part]


def lora_ranks(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Module -> rank of its LoRA."""
    return {m: shapes[f"{m}.lora_a"][0] for m in MODULES if f"{m}.lora_a" in shapes}


def weights(tensors: dict[str, torch.Tensor], token_rows: dict[str, tuple[int, ...]]) -> VocabWeights:
    def lora(module):
        a = tensors.get(f"{module}.lora_a")
        return None if a is None else ModuleLora(a, tensors[f"{module}.lora_b_t"])

    def rows(module):
        return (
            TokenRows(token_rows[module], tensors[f"{module}.token_rows"]) if module in token_rows else None
        )

    return VocabWeights(
        embed_lora=lora("embed_tokens"),
        head_lora=lora("lm_head"),
        embed=tensors.get("embed_tokens.weight"),
        head=tensors.get("lm_head.weight"),
        embed_rows=rows("embed_tokens"),
        head_rows=rows("lm_head"),
    )

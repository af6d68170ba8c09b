"""The optimized adapter wire format: one safetensors blob, identified by its sha256.

Tensors are named `layers.{i}.{module}.lora_a` ([rank, in]) and `.lora_b_t` ([rank, out]: B
transposed, scaling merged), in the serving dtype: the kernels' layout. An MoE layer's experts
hold one LoRA per expert, stacked: [experts, rank, in] and [experts, rank, out]. safetensors writes
metadata keys in hash order, so rank, alpha and the format version sit in one key as sorted
JSON: the same content always encodes to the same bytes, hence the same digest. The
vocabulary side's tensors (embed_tokens.*, lm_head.*) are vocab_blob.py's; a blob without them is
byte for byte what it was before they existed.
"""

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from shared import vocab_blob
from shared.adapter_weights import AdapterWeights, ModuleLora
from shared.errors import FailedPrecondition, quoted
from shared.model_config import MODULE_PARENTS, LinearShape, ModelConfig
from shared.nonfinite import first_nonfinite

FORMAT = "loramux-adapter/2"
METADATA_KEY = "loramux"
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}  # torch -> safetensors
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# A bounded layer number: int() of thousands of digits is itself an error.
TENSOR_NAME = re.compile(r"layers\.(-?[0-9]{1,9})\.([a-z_]{1,32})\.(lora_a|lora_b_t)")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16" or "float16"


@dataclass(frozen=True)
class BlobInfo:
    """What a blob holds, read from its header alone."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dtype: str
    tensors: tuple[TensorInfo, ...]


def encode(weights: AdapterWeights) -> bytes:
    return save(_named_tensors(weights), metadata=_metadata(weights))


def digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def file_digest(f: BinaryIO) -> str:
    """The digest of a blob file's bytes from where `f` stands to its end, read in chunks."""
    return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def digest_of(weights: AdapterWeights) -> str:
    """digest(encode(weights)), hashed straight from the tensors: the blob is never built, which
    saves a loader that only needs the identity a copy of every weight. The bytes hashed are the
    ones safetensors writes: an 8-byte little-endian header length, the header JSON (metadata
    first, then each tensor's dtype, shape and offsets) padded with spaces to 8 bytes, then the
    tensors' data back to back, in the order of their names (all share the serving dtype)."""
    tensors = dict(sorted(_named_tensors(weights).items()))
    if len({t.dtype for t in tensors.values()}) != 1:
        raise ValueError("an adapter's weights must share one dtype, the serving dtype")
    header: dict[str, object] = {"__metadata__": _metadata(weights)}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    sha = hashlib.sha256(struct.pack("<Q", len(text)) + text)
    for tensor in tensors.values():
        sha.update(tensor.contiguous().view(-1).view(torch.uint8).numpy())
    return "sha256:" + sha.hexdigest()


def _named_tensors(weights: AdapterWeights) -> dict[str, torch.Tensor]:
    tensors = {}
    for (layer, module), m in weights.modules.items():
        tensors[f"layers.{layer}.{module}.lora_a"] = m.a
        tensors[f"layers.{layer}.{module}.lora_b_t"] = m.b_t
    return tensors | weights.vocab.tensors


def _metadata(weights: AdapterWeights) -> dict[str, str]:
    metadata = {
        "format": FORMAT,
        "rank": weights.rank,
        "alpha": weights.alpha,
        "target_modules": list(weights.target_modules),
    }
    if weights.vocab.token_indices:
        metadata["token_rows"] = weights.vocab.token_indices
    return {METADATA_KEY: json.dumps(metadata, sort_keys=True)}


def check_digest(text: str, where: str) -> str:
    """`text` if it is a digest this format can name ("sha256:" + 64 lowercase hex), else
    FailedPrecondition: only such a digest may become a file name."""
    if not is_digest(text):
        raise FailedPrecondition(
            f"{where} gave digest {quoted(text)}, which is not 'sha256:' followed by 64 lowercase "
            "hex digits; the adapter cannot be served"
        )
    return text


def is_digest(text: object) -> bool:
    return isinstance(text, str) and DIGEST.fullmatch(text) is not None


def file_name(digest: str) -> str:
    """The cache file name of a blob: "sha256-<hex>", never a path of the digest's choosing."""
    return check_digest(digest, "a cache lookup").replace(":", "-")


def decode(
    blob: bytes, where: str = "adapter blob", model: ModelConfig | None = None, max_rank: int | None = None
) -> AdapterWeights:
    """The weights in `blob`, every part checked before anything trusts it: header, metadata,
    tensor names, dtypes, shapes (against the declared rank, and `model` and `max_rank` when
    given) and finite values. Every defect is FailedPrecondition naming `where` and the tensor."""
    header = _header(blob, where)
    declared = _declared(header.pop("__metadata__", None), where)
    vocab_shapes = {
        name: _tensor_shape(name, header.pop(name), where)
        for name in list(header)
        if vocab_blob.TENSOR_NAME.fullmatch(name)
    }
    vocab_blob.check_shapes(vocab_shapes, declared.target_modules, declared.token_rows, model, where)
    shapes = _tensor_shapes(header, declared, model, bool(vocab_shapes), where)
    _check_ranks(shapes, vocab_blob.lora_ranks(vocab_shapes), declared, max_rank, where)
    tensors = _tensors(blob, where)
    modules = {
        (layer, module): ModuleLora(
            tensors[f"layers.{layer}.{module}.lora_a"], tensors[f"layers.{layer}.{module}.lora_b_t"]
        )
        for layer, module in sorted(shapes)
    }
    vocab = vocab_blob.weights(tensors, declared.token_rows)
    return AdapterWeights(declared.rank, declared.alpha, declared.target_modules, modules, vocab)


@dataclass(frozen=True)
class _Declared:
    """What the blob's metadata says about its weights."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    token_rows: dict[str, tuple[int, ...]]  # module -> the token ids of its re-trained rows


def _header(blob: bytes, where: str) -> dict:
    if len(blob) < 8:
        raise FailedPrecondition(f"{where}: the blob is {len(blob)} bytes, too short for a safetensors file")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > len(blob) - 8:
        raise FailedPrecondition(
            f"{where}: the blob's safetensors header claims {size} bytes; the blob has {len(blob)} bytes"
        )
    try:
        header = json.loads(blob[8 : 8 + size])
    except (ValueError, RecursionError):
        raise FailedPrecondition(f"{where}: the blob's safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise FailedPrecondition(f"{where}: the blob's safetensors header is not a JSON object")
    return header


def _declared(metadata: object, where: str) -> _Declared:
    raw = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict):
        raise FailedPrecondition(f"{where}: the blob has no {METADATA_KEY!r} metadata JSON object")
    if meta.get("format") != FORMAT:
        raise FailedPrecondition(f"{where}: blob format {quoted(meta.get('format'))}, expected {FORMAT!r}")
    rank, alpha, targets = meta.get("rank"), meta.get("alpha"), meta.get("target_modules")
    if not _is_int(rank) or rank < 1:
        raise FailedPrecondition(
            f"{where}: the blob's metadata rank {quoted(rank)} is not a positive integer"
        )
    if not (_is_int(alpha) or isinstance(alpha, float)) or not math.isfinite(alpha):
        raise FailedPrecondition(f"{where}: the blob's metadata alpha {quoted(alpha)} is not a finite number")
    modules = (*MODULE_PARENTS, *vocab_blob.MODULES)
    if not isinstance(targets, list) or not all(isinstance(t, str) and t in modules for t in targets):
        raise FailedPrecondition(
            f"{where}: the blob's metadata target_modules {quoted(targets)} is not a list of LoRA "
            f"target modules ({', '.join(modules)})"
        )
    token_rows = vocab_blob.check_token_rows(meta.get("token_rows"), where)
    return _Declared(rank, float(alpha), tuple(targets), token_rows)


def _tensor_shapes(
    header: dict, declared: _Declared, model: ModelConfig | None, vocab: bool, where: str
) -> dict:
    """(layer, module) -> {"lora_a": shape, "lora_b_t": shape}, every tensor accounted for
    (`vocab`: the blob holds vocabulary-side tensors, which may be all it holds)."""
    pairs: dict[tuple[int, str], dict[str, tuple[int, int]]] = {}
    for name, entry in header.items():
        layer, module, half = _tensor_key(name, declared, model, where)
        pairs.setdefault((layer, module), {})[half] = _tensor_shape(name, entry, where)
    if not pairs and not vocab:
        raise FailedPrecondition(f"{where}: the blob holds no LoRA tensors")
    shapes = model.linear_shapes() if model else {}
    for (layer, module), pair in pairs.items():
        missing = {"lora_a", "lora_b_t"} - pair.keys()
        if missing:
            raise FailedPrecondition(f"{where}: layers.{layer}.{module} has no {missing.pop()} tensor")
        _check_module(f"{where}: layers.{layer}.{module}", pair, shapes.get(module))
    return pairs


def _tensor_key(
    name: str, declared: _Declared, model: ModelConfig | None, where: str
) -> tuple[int, str, str]:
    match = TENSOR_NAME.fullmatch(name)
    if not match or match[2] not in MODULE_PARENTS:
        raise FailedPrecondition(
            f"{where}: tensor {quoted(name)} is not a LoRA tensor (layers.<layer>.<module>.lora_a or "
            f".lora_b_t, module one of {', '.join(MODULE_PARENTS)}; or embed_tokens. or lm_head. then "
            "lora_a, lora_b_t, weight or token_rows)"
        )
    layer, module = int(match[1]), match[2]
    if model and module not in model.lora_targets:
        raise FailedPrecondition(
            f"{where}: tensor {name} adapts {module}, which LoRA cannot target on this model "
            f"({model.model_type}: {', '.join(model.lora_targets)})"
        )
    layers = model.num_layers if model else None
    if layer < 0 or (layers is not None and layer >= layers):
        within = f"0 to {layers - 1}" if layers else "non-negative"
        raise FailedPrecondition(
            f"{where}: tensor {name} is for layer {layer}; this model's layers are {within}"
        )
    if module not in declared.target_modules:
        raise FailedPrecondition(
            f"{where}: tensor {name} adapts {module}, which the blob's target_modules "
            f"{list(declared.target_modules)} do not name"
        )
    return layer, module, match[3]


def _tensor_shape(name: str, entry: object, where: str) -> tuple[int, int]:
    dtype = entry.get("dtype") if isinstance(entry, dict) else None
    if dtype not in SAFETENSORS_DTYPES:
        raise FailedPrecondition(
            f"{where}: tensor {name} has dtype {quoted(dtype)}; F16, BF16 or F32 expected"
        )
    shape = entry.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) not in (2, 3)
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise FailedPrecondition(
            f"{where}: tensor {name} has shape {quoted(shape)}; a matrix (or one per expert) expected"
        )
    return tuple(shape)


def _check_module(label: str, pair: dict[str, tuple[int, ...]], want: LinearShape | None) -> None:
    a, b_t = pair["lora_a"], pair["lora_b_t"]
    if len(a) != len(b_t) or a[:-1] != b_t[:-1] or a[-2] < 1:
        raise FailedPrecondition(
            f"{label}: lora_a {list(a)} and lora_b_t {list(b_t)} must share a rank of at least 1 "
            "(and an expert count)"
        )
    if want is None:
        return
    stack = [want.experts] if want.experts > 1 else []
    if list(a) != [*stack, a[-2], want.in_features] or list(b_t) != [*stack, a[-2], want.out_features]:
        raise FailedPrecondition(
            f"{label}: lora_a {list(a)} and lora_b_t {list(b_t)}; this worker's model expects "
            f"[{', '.join(map(str, [*stack, 'r', want.in_features]))}] and "
            f"[{', '.join(map(str, [*stack, 'r', want.out_features]))}]"
        )


def _check_ranks(
    shapes: dict, vocab_ranks: dict[str, int], declared: _Declared, max_rank: int | None, where: str
) -> None:
    """The largest module rank (the vocabulary side's LoRA included) is the declared one."""
    ranks = {f"layers.{layer}.{module}": pair["lora_a"][-2] for (layer, module), pair in shapes.items()}
    ranks |= vocab_ranks
    if not ranks:
        return  # no LoRA: only the vocabulary side's own matrices or rows
    module, largest = max(ranks.items(), key=lambda item: item[1])
    if largest != declared.rank:
        raise FailedPrecondition(
            f"{where}: {module} has rank {largest}, but the blob's metadata declares "
            f"rank {declared.rank} (the largest module rank)"
        )
    if max_rank is not None and largest > max_rank:
        raise FailedPrecondition(f"{where} has rank {largest}, above this worker's max_lora_rank {max_rank}")


def _tensors(blob: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        tensors = load(blob)
    except (SafetensorError, ValueError, RuntimeError):
        raise FailedPrecondition(
            f"{where}: the blob's tensor data does not match its safetensors header (offsets or sizes)"
        ) from None
    bad = first_nonfinite(tensors)
    if bad is not None:
        raise FailedPrecondition(f"{where}: tensor {bad} contains NaN or Inf values")
    return tensors


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_info(f: BinaryIO) -> BlobInfo:
    """The header of the blob open in `f` (read from its start)."""
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    metadata = json.loads((header.pop("__metadata__", None) or {}).get(METADATA_KEY, "{}"))
    tensors = tuple(
        TensorInfo(name, tuple(t["shape"]), SAFETENSORS_DTYPES[t["dtype"]])
        for name, t in sorted(header.items())
    )
    return BlobInfo(
        int(metadata["rank"]),
        float(metadata["alpha"]),
        tuple(metadata["target_modules"]),
        tensors[0].dtype,
        tensors,
    )

"""Weights transformers saved pre-quantized: bitsandbytes NF4 and torchao int8, each loaded
whole or, under tensor parallelism, as the rank's rows or columns of its parts."""

import json

import torch

from inference_service.model.base_weight import Int8Weight, Nf4Weight
from inference_service.model.checkpoint import Checkpoint, Part, Rows, Target
from kernels.nf4_linear import BLOCK, dequantize_nested_absmax, nf4_code
from shared.errors import InvalidArgument

# What transformers saves beside a bitsandbytes 4-bit weight "X.weight" (itself the packed codes).
NF4_STATE = ".quant_state.bitsandbytes__nf4"
NF4_PARTS = (NF4_STATE, ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
# What transformers saves for a torchao Int8Tensor weight "X.weight": "X._weight_qdata" and these.
INT8_DATA = "._weight_qdata"
INT8_PARTS = ("._weight_scale", "._weight_zero_point")


def _quantized_target(target, name: str, kind: str, layer_type: type) -> Rows:
    if not isinstance(target, Rows) or not isinstance(target.base, layer_type):
        raise InvalidArgument(f"tensor {name} is {kind}, but its layer is not held in {kind}")
    return target


def load_nf4(checkpoint: Checkpoint, name: str, target: Target) -> None:
    """A bitsandbytes NF4 weight as transformers saves it: the packed codes, the quant state (JSON
    in a uint8 tensor), the 16-value map and the absmax, double-quantized or not; of this rank's
    part, its blocks (Shard.check_quantized: a part is whole blocks)."""
    rows_of = _quantized_target(target.dst, name, "NF4", Nf4Weight)
    state = json.loads(bytes(checkpoint.get(name + NF4_STATE).tolist()))
    rows, columns = _whole_shape(rows_of.shape, target.part)
    expected = {"quant_type": "nf4", "blocksize": BLOCK, "shape": [rows, columns]}
    found = {key: state.get(key) for key in expected}
    if found != expected:
        raise InvalidArgument(f"tensor {name}: quant state {found}, the model expects {expected}")
    if not torch.equal(checkpoint.get(name + ".quant_map").float(), nf4_code()):
        raise InvalidArgument(f"tensor {name}.quant_map is not the NF4 code")
    absmax = checkpoint.get(name + ".absmax")
    if "nested_blocksize" in state:
        nested = (checkpoint.get(name + ".nested_absmax"), checkpoint.get(name + ".nested_quant_map"))
        absmax = dequantize_nested_absmax(absmax, *nested, state["nested_offset"], state["nested_blocksize"])
    packed = checkpoint.get(name).flatten()
    if (packed.numel(), absmax.numel()) != (rows * columns // 2, rows * columns // BLOCK):
        raise InvalidArgument(
            f"tensor {name}: {packed.numel()} bytes and {absmax.numel()} absmax for {rows}x{columns}"
        )
    packed, absmax = _nf4_part(packed, absmax.float(), columns, target.part)
    rows_of.base.load_quantized(rows_of.offset, packed, absmax)


def _whole_shape(shape: tuple[int, int], part: Part | None) -> tuple[int, int]:
    """The checkpoint tensor's shape, of which this rank's part is `shape`."""
    if part is None:
        return shape
    whole = list(shape)
    whole[part.dim] = part.size
    return whole[0], whole[1]


def _nf4_part(packed: torch.Tensor, absmax: torch.Tensor, columns: int, part: Part | None):
    """This rank's codes (two a byte) and absmax (one per 64 values) of a whole NF4 weight:
    its rows are a flat run of whole blocks, its columns whole blocks of every row."""
    if part is None:
        return packed, absmax
    if part.dim == 0:
        first, last = part.start * columns, part.stop * columns
        return packed[first // 2 : last // 2], absmax[first // BLOCK : last // BLOCK]
    codes, blocks = packed.view(-1, columns // 2), absmax.view(-1, columns // BLOCK)
    return (
        codes[:, part.start // 2 : part.stop // 2].reshape(-1),
        blocks[:, part.start // BLOCK : part.stop // BLOCK].reshape(-1),
    )


def load_int8(checkpoint: Checkpoint, module: str, target: Target) -> None:
    """A torchao Int8Tensor as transformers saves it: int8 codes [out, in], a scale [out, 1] and a
    zero point [out, 1] that symmetric per-row quantization leaves at zero; of this rank's part,
    its rows' codes and scales, or its columns of every row's codes and every scale."""
    name = module + INT8_DATA
    rows_of = _quantized_target(target.dst, name, "int8", Int8Weight)
    rows, columns = rows_of.shape
    part = target.part
    scale_part = part if part is not None and part.dim == 0 else None
    q, scale = checkpoint.get(name, part), checkpoint.get(module + "._weight_scale", scale_part)
    if q.dtype != torch.int8 or tuple(q.shape) != (rows, columns):
        raise InvalidArgument(
            f"tensor {name} is {q.dtype} {tuple(q.shape)}, the model expects torch.int8 {(rows, columns)}"
        )
    if scale.numel() != rows:
        raise InvalidArgument(
            f"tensor {module}._weight_scale has {scale.numel()} scales, not one per row ({rows})"
        )
    zero_point = module + "._weight_zero_point"
    if zero_point in checkpoint and checkpoint.get(zero_point).any():
        raise InvalidArgument(f"tensor {zero_point} is not zero: only symmetric int8 is supported")
    rows_of.base.load_quantized(rows_of.offset, q, scale.flatten().float())

"""The tl.dot both LoRA kernels use: fp32 accumulation without TF32 rounding, so fp32 results
match the references, and fp32 operands under Triton's interpreter, whose numpy matmul gets
bfloat16 operands wrong."""

import triton
import triton.language as tl


def dot_in_fp32() -> bool:
    return triton.knobs.runtime.interpret


@triton.jit
def dot(a, b, FP32: tl.constexpr):
    if FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")

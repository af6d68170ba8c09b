"""The tl.dot the Triton kernels use: fp32 accumulation without TF32 rounding, so fp32 results
match the references, and fp32 operands under Triton's interpreter, whose numpy matmul would
multiply bfloat16's bit patterns (it stores them as uint16) as integers.

The fp32 operands change nothing but the order of the sums. On a GPU, tl.dot multiplies the
bf16/fp16 operands as loaded, exactly (two significands of 8 or 11 bits make at most 22, within
fp32's 24), and adds the products in fp32. The interpreter's cast to fp32 is exact too (every
bf16 and fp16 value is an fp32 value), so numpy multiplies the same exact products and adds them
in fp32, in another order. tests/kernels/rounding.py bounds that fp32 summation for either, and
test_lora_triton holds the shrink kernel on bf16 and fp16 operands to it: an fp32 bound. What
the interpreter cannot show is the compiled tensor-core code, which only the gpu-marked tests
run. (Casts to bf16 elsewhere in the kernels do differ: the interpreter truncates, a GPU rounds
to nearest, and the tests' bounds allow a whole ulp for each.)
"""

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

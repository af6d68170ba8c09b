"""The CPU rotary kernel against torch's apply_rope, which the torch path runs: the same rounding
of every product and sum, so the same bits, in every dtype; heads past q's and k's (v's) and
elements past a row's heads are left as they were."""

import pytest
import torch

from inference_service.model.rope import apply_rope, cos_sin, inverse_frequencies
from kernels.cpu_rope import CpuRope
from shared.model_config import RopeConfig

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernel(target) -> CpuRope:
    # the workers' folder: one build (of each target) serves tests and engines
    kernel, why = CpuRope.load(target=target)
    assert kernel is not None, why
    return kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 80), (2, 1, 24), (1, 1, 16)])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rope_in_place_equals_apply_rope(kernel, dtype, heads, kv_heads, head_dim, tokens):
    rope = RopeConfig(theta=10000.0)
    positions = torch.randint(0, 4000, (tokens,))
    cos, sin = cos_sin(inverse_frequencies(rope, head_dim), positions, dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (torch.randn(tokens, q_size + 2 * kv_size) * 4).to(dtype)
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    expected_q = apply_rope(q.reshape(tokens, heads, head_dim), cos, sin).reshape(tokens, q_size)
    expected_k = apply_rope(k.reshape(tokens, kv_heads, head_dim), cos, sin).reshape(tokens, kv_size)
    v_before = v.clone()
    kernel(qkv, cos, sin, heads + kv_heads, head_dim)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, v_before)


def test_tables_of_another_dtype_are_refused(kernel):
    """The library reads cos and sin as qkv's dtype: a mismatch would read garbage, not fail."""
    cos, sin = cos_sin(
        inverse_frequencies(RopeConfig(theta=10000.0, rope_type="default"), 16),
        torch.arange(3),
        torch.float32,
    )
    with pytest.raises(AssertionError):
        kernel(torch.randn(3, 48, dtype=torch.bfloat16), cos, sin, 2, 16)

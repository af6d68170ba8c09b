"""The LoRA shrink and expand kernels' cases and bounds, shared by the Triton pair's tests and the
CPU pair's: random adapters in paged memory, token spreads over them, and how far a result may
be from the plain loop references (tests/kernels/rounding.py derives the bounds)."""

import torch

from kernels.lora_batch import PAGE_RANK, LoraBatch, page_views
from kernels.lora_expand import lora_expand_ref
from kernels.lora_shrink import lora_shrink_ref
from tests.kernels.paged_adapters import RANKS, UNIT, paged_adapters
from tests.kernels.rounding import assert_within, cast_error, fp32_error, gamma
from tests.kernels.slot_spread import token_slots

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# slices -> (first target, slice sizes): o; gate/up; q/k/v, uneven with GQA
SLICES = {1: (3, (40,)), 2: (4, (48, 48)), 3: (0, (72, 24, 24))}


def case(spread, slices, base_every, dtype, tokens, in_features, sizes, device="cpu", gathered=1):
    first_target = SLICES[slices][0]
    torch.manual_seed(0)
    pool, adapters = paged_adapters(first_target, in_features, sizes, dtype, device, gathered=gathered)
    slots = token_slots(spread, tokens, len(RANKS), base_every, grouped=False, seed=slices)
    table = LoraBatch.build(slots, adapters, device, kernels=True).table
    return slots, pool, adapters, table


def shrink_close(partials, x, pool, slots, adapters, first_target, slices):
    """The sum of the partials [splits, tokens, slices, max_rank] (fp32, never cast) against the
    reference on the lora rows: each term is one product and at most in_features - 1 fp32
    additions, whichever the split and tile order, so bf16 and fp16 operands are held to fp32's
    bound too (their products are exact in fp32), and lanes past every rank are 0."""
    lora_rows = torch.tensor(slots) >= 0  # rows of base-model tokens are not written
    exact = lora_shrink_ref(x, pool, UNIT, slots, adapters, first_target, slices)[lora_rows]
    magnitude = lora_shrink_ref(x.abs(), pool.abs(), UNIT, slots, adapters, first_target, slices)[lora_rows]
    got = partials.sum(0).cpu()[lora_rows]  # [lora tokens, slices, max_rank]
    rank = exact.shape[2]
    assert_within(got[:, :, :rank], exact, gamma(x.shape[1] * fp32_error(partials.device)) * magnitude)
    assert not got[:, :, rank:].any()


def expand_close(
    got, y, partials, pool, slots, adapters, first_target, sizes, in_features, gathered=1, casts=2
):
    """y's new value against the reference on the partials' exact sum: a term of it (one split's
    lane times a B element) goes through the additions of the splits, the cast of their sum to
    the pool's dtype, one product, at most max_rank - 1 additions and the one to y, and the cast
    to y's dtype; casts=3 where the product's sum is rounded to y's dtype before the addition
    too, as PEFT's lora_B output is."""
    splits, _, _, max_rank = partials.shape
    exact_buf, buf_magnitude = partials.cpu().double().sum(0), partials.cpu().double().abs().sum(0)
    y, pool = y.cpu().double(), pool.cpu().double()
    args = (UNIT, slots, adapters, first_target, sizes, in_features, gathered)
    exact = lora_expand_ref(y, exact_buf, pool, *args)
    magnitude = lora_expand_ref(y.abs(), buf_magnitude, pool.abs(), *args)
    bound = gamma((splits + max_rank + 1) * fp32_error(got.device) + casts * cast_error(got.dtype))
    assert_within(got, exact, bound * magnitude)


def whole_pages(first_target: int, in_features: int, sizes: tuple[int, ...], dtype: torch.dtype):
    """paged_adapters with the rows past each rank in a last page zeroed, as ModelRunner leaves
    them (lora_bmm reads whole pages); everything else outside the pages stays NaN."""
    pool, adapters = paged_adapters(first_target, in_features, sizes, dtype)
    for pages in adapters.values():
        for s, size in enumerate(sizes):
            rank, units = pages.ranks[first_target + s], pages.pages[first_target + s]
            a, b = page_views(pool, UNIT, in_features, size)
            if rank % PAGE_RANK:
                a[units[-1], rank % PAGE_RANK :] = 0
                b[units[-1], rank % PAGE_RANK :] = 0
    return pool, adapters


def lora_bound(y, x, pool, slots, adapters, target):
    """How far a LoRA path that rounds as PEFT does (lora_bmm, the CPU kernels' shrink_expand) may
    be from lora_ref on fp64 operands, in two stages, as lora_A's output
    s_j = A_j x is cast to the dtype in between. Summed in fp32 (one product and at most
    in - 1 additions a term, gamma_1 = gamma(in * fp32_error)) and cast (c = cast_error),
    s_j is off by at most (1 + c)(gamma_1 m_j + c |s_j|), m_j = sum_i |A_ji x_i|. Then
    y + sum_j s_j B_j, whose terms take at most rank - 1 additions, the cast of the sum, the
    addition to y and the cast of the result, is off by gamma_2 (|y| + sum_j |s_j B_j|) more,
    gamma_2 = gamma((rank + 1) * fp32_error + 2c), s_j being the computed ones, each within
    its error of the exact one. With M1 = sum_j |B_j| m_j and M2 = sum_j |B_j s_j|, that is
    (1 + gamma_2)(1 + c)(gamma_1 M1 + c M2) + gamma_2 (|y| + M2)."""
    in_features, size = x.shape[1], y.shape[1]
    c, fp32 = cast_error(x.dtype), fp32_error(x.device)
    gamma_1 = gamma(in_features * fp32)
    gamma_2 = gamma((max(map(max, RANKS)) + 1) * fp32 + 2 * c)
    a, b = page_views(pool.double(), UNIT, in_features, size)
    m1 = torch.zeros(y.shape, dtype=torch.float64)  # [tokens, size]
    m2 = torch.zeros_like(m1)
    for i, slot in enumerate(slots):
        rank = adapters[slot].ranks[target] if slot >= 0 else 0
        if rank:
            pages = list(adapters[slot].pages[target])
            a_rows = a[pages].reshape(-1, in_features)[:rank]  # [r, in]
            b_rows = b[pages].reshape(-1, size)[:rank].abs()  # [r, size]
            m1[i] = (a_rows.abs() @ x[i].double().abs()) @ b_rows
            m2[i] = (a_rows @ x[i].double()).abs() @ b_rows
    return (1 + gamma_2) * (1 + c) * (gamma_1 * m1 + c * m2) + gamma_2 * (y.double().abs() + m2)

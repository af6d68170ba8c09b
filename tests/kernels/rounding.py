"""How far a kernel's result may be from its fp64 reference: bounds derived from the roundings the
kernel makes, so that no test depends on how one machine happens to round.

Each result is a sum of terms (an inner product, a softmax average). Computed, a term t goes
through roundings (its product, the additions it takes part in, casts to a narrower dtype),
each multiplying it by some (1 + d) with |d| at most that rounding's relative error u_k. With
s = u_1 + u_2 + ... over the roundings of any one term, the term comes out as t (1 + theta),
|theta| <= gamma(s) = s / (1 - s) (Higham, Accuracy and Stability of Numerical Algorithms,
lemma 3.1, whose proof holds for mixed u_k), so

    |got - exact| <= gamma(s) * sum |t|,

and sum |t| is the reference computed on the operands' absolute values. A sum of n terms added
in any order (any tree of additions, tl.dot's or numpy's or a split's) takes each term through
at most n - 1 additions, and adding an exact zero (a padded lane) rounds nothing. A final cast
to the output's dtype multiplies every term by the same (1 + d): it adds cast_error to s.
"""

import math

import torch

EXP2 = (
    2.0**-22
)  # tl.exp2's relative error, taken as two ulps: CUDA documents that for exp2f; numpy does better


def fp32_error(device: torch.device) -> float:
    """The largest relative error of one fp32 operation (an addition or a product) of a result
    computed on `device`. On a CPU (Triton's interpreter is numpy) every one rounds to nearest:
    2^-24. On a GPU, tl.dot's tensor cores align each block of products to the largest and
    truncate (Fasi, Higham, Mikaitis and Pranesh, Numerical behavior of NVIDIA tensor cores,
    2021): two ulps at 1, 2^-22, leave room for that."""
    return 2.0**-22 if device.type == "cuda" else 2.0**-24


def cast_error(dtype: torch.dtype) -> float:
    """The largest relative error of a cast to `dtype`: one ulp at 1 (2^-23 fp32, 2^-10 fp16,
    2^-7 bf16). Rounding to nearest costs half of it, but Triton's interpreter truncates fp32 to
    bf16 where a GPU rounds to nearest."""
    return torch.finfo(dtype).eps


def gamma(s):
    assert (s < 1).all() if isinstance(s, torch.Tensor) else s < 1
    return s / (1 - s)


def assert_within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    """|got - exact| <= bound everywhere; NaN in got fails."""
    error = (got.cpu().double() - exact).abs()
    outside = ~(error <= bound)
    assert not outside.any(), (
        f"{int(outside.sum())} of {error.numel()} elements outside the bound; worst at "
        f"{tuple(int(i) for i in torch.nonzero(outside)[0])}: error {error[outside].max():.3g}, "
        f"bound there {bound.expand_as(error)[outside][0]:.3g}"
    )


def softmax_average_bound(
    magnitude: torch.Tensor,
    *,
    scores: torch.Tensor,
    head_dim: int,
    keys: int,
    rescales: int,
    values: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The bound for attention computed as flash attention does it: out = N / D with
    N = sum_j w_j v_j, D = sum_j w_j, w_j = 2^(t_j - m), t_j = scale * log2(e) * q . k_j, m a
    running max.

    magnitude: the reference computed with |v|, sum_j softmax_j |v_j| (at least |exact|);
    scores: at least scale * log2(e) * sum_d |q_d k_jd| for every key j of the row, so at least
    |t_j| (it broadcasts over head_dim); keys: the most keys a row sums over; rescales: the most
    times a row's running sums are rescaled (once per key tile after its first, once more to
    merge splits); values: the largest |v|; dtype: q, k, v's and the output's; device: where the
    kernel ran.

    If each term of N is off by a relative error of at most e_N and each term of D by at most
    e_D, |N/D - exact| <= (e_N + e_D) / (1 - e_D) * magnitude <= gamma(e_N + e_D) * magnitude.
    A term's w_j is off by a factor of at most 2^x for an absolute error x of its exponent:
    head_dim roundings of the dot and two of the scale (its fp32 form, the product), each at
    most fp32_error * scores, and one of t_j - m and one per rescale (alpha's argument), of
    numbers up to `scores` each: twice that. Then there are exp2's own errors (its own and one
    per rescale), the products by alpha (one per rescale), the additions (keys, each term's
    product included) and the division: that is e. N's terms also take the cast of w_j to v's
    dtype before tl.dot, so e_N = e + cast_error and e_D = e, and the result's cast adds one more
    cast_error. Last, a w_j below the normal range of v's dtype (fp16's starts at 2^-14) is off
    by half a subnormal step, tiny * cast_error / 2, or flushed to zero by a GPU's fp32 exp2,
    at most fp32's tiny, absolutely; as D >= 1 (the largest w_j is 1) and |out| <= values, N and
    D take keys * underflow * values each.
    """
    cast, fp32 = cast_error(dtype), fp32_error(device)
    exponent = fp32 * scores * (head_dim + 2 + 2 * (1 + rescales))
    e = (2**exponent - 1) + EXP2 * (1 + rescales) + fp32 * (rescales + keys + 1)
    underflow = torch.finfo(dtype).tiny * cast / 2 + torch.finfo(torch.float32).tiny
    return gamma(2 * e + 2 * cast) * magnitude + 2 * keys * underflow * values


def score_magnitude(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """[tokens, heads, 1]: scale * log2(e) * the largest sum_d |q_d k_d| of each row of q over the
    keys of its kv head in the whole cache (its NaN rows aside), so over every key it sees."""
    keys = k_cache.double().nan_to_num(0.0).abs().flatten(0, 1)  # [blocks*block_size, kv_heads, hd]
    kv_heads = keys.shape[1]
    queries = q.double().abs().unflatten(1, (kv_heads, -1))  # [tokens, kv_heads, group, hd]
    largest = [(queries[:, h] @ keys[:, h].T).amax(-1) for h in range(kv_heads)]  # [tokens, group] each
    return (torch.stack(largest, 1).flatten(1) * scale * math.log2(math.e)).unsqueeze(-1).cpu()


def attention_bound(
    magnitude: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    *,
    keys: int,
    rescales: int,
    device: torch.device,
) -> torch.Tensor:
    """softmax_average_bound for attention of q over a paged cache [blocks, block_size, kv_heads,
    head_dim] (its NaN entries, never read, aside), in q's dtype."""
    return softmax_average_bound(
        magnitude,
        scores=score_magnitude(q, k_cache, scale),
        head_dim=q.shape[-1],
        keys=keys,
        rescales=rescales,
        values=float(v_cache.nan_to_num(0.0).abs().max()),
        dtype=q.dtype,
        device=device,
    )

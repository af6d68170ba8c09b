"""The CPU LoRA kernels on paged adapter memory against the plain loop references, on the cases the
Triton pair is checked on (tests/kernels/lora_checks.py): the pool holds NaN wherever a kernel
must not read, so a stray read fails the comparison. Widths that are not a multiple of the
vector's sixteen lanes, and segments longer than one task's tokens, are among them."""

import dataclasses

import pytest
import torch

from inference_service.model.lora_linear import add_lora
from kernels.cpu_linear import CpuLinear
from kernels.cpu_lora import CpuLora
from kernels.int8_linear import quantize_int8_rows
from kernels.lora_batch import RUN_ROWS, LoraBatch
from kernels.lora_bmm import lora_ref
from kernels.nf4_linear import quantize_nf4
from tests.kernels.guard_pages import guarded, in_child
from tests.kernels.lora_checks import (
    DTYPES,
    SLICES,
    case,
    expand_close,
    lora_bound,
    shrink_close,
)
from tests.kernels.paged_adapters import UNIT, paged_adapters
from tests.kernels.rounding import assert_within
from tests.kernels.slot_spread import SPREADS


@pytest.fixture(scope="module")
def kernel(target) -> CpuLora:
    # the workers' folder: one build (of each target) serves tests and engines
    kernel, why = CpuLora.load(target=target)
    assert kernel is not None, why
    return kernel


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_matches_reference(kernel, spread, slices, base_every, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = case(spread, slices, base_every, dtype, 37, 136, sizes)
    x = torch.randn(37, 136, dtype=dtype)
    partials = kernel.step(table).shrink(x, pool, first_target, slices, UNIT)
    assert partials.shape == (1, 37, slices, table.max_rank) and partials.dtype == torch.float32
    shrink_close(partials, x, pool, slots, adapters, first_target, slices)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_matches_reference(kernel, spread, slices, base_every, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = case(spread, slices, base_every, dtype, 37, 72, sizes)
    y = torch.randn(37, sum(sizes), dtype=dtype)
    partials = torch.randn(1, 37, slices, table.max_rank)  # lanes past a rank must not count
    y_old = y.clone()
    out = kernel.step(table).expand(y, partials, pool, first_target, sizes, 72, UNIT)
    assert out is y
    expand_close(out, y_old, partials, pool, slots, adapters, first_target, sizes, 72, casts=3)
    base_rows = torch.tensor(slots) < 0
    assert torch.equal(out[base_rows], y_old[base_rows])


@pytest.mark.parametrize("gathered", [2, 3])
@pytest.mark.parametrize("slices", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_reads_every_ranks_shrink_of_a_fully_sharded_layer(kernel, gathered, slices, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = case("uniform", slices, 3, dtype, 37, 72, sizes, gathered=gathered)
    y = torch.randn(37, sum(sizes), dtype=dtype)
    partials = torch.randn(1, 37, slices, gathered * table.max_rank)
    y_old = y.clone()
    out = kernel.step(table).expand(y, partials, pool, first_target, sizes, 72, UNIT, gathered)
    expand_close(out, y_old, partials, pool, slots, adapters, first_target, sizes, 72, gathered, casts=3)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("tokens", [1, 37, 75])  # 75: an adapter's segment in several tasks
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_expand_in_one_pass_rounds_as_peft(kernel, spread, slices, base_every, tokens, dtype):
    """lora_A's output rounded to the dtype, then lora_B's, then their sum with y (lora_ref)."""
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = case(spread, slices, base_every, dtype, tokens, 40, sizes)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 40, generator=generator).to(dtype)
    y = torch.randn(tokens, sum(sizes), generator=generator).to(dtype)
    out = y.clone()
    if table is not None:  # None: no token uses an adapter (one base-model token), and no call is made
        kernel.step(table).shrink_expand(out, x, pool, first_target, sizes, UNIT)
    _assert_rounds_as_peft(out, y, x, pool, slots, adapters, first_target, sizes)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("tokens", [1, 37, 75, 300])  # 300: rows in three blocks of CpuLinear.block_rows
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    "weights",
    [
        torch.float32,
        torch.bfloat16,
        pytest.param((torch.int8, torch.float32), id="int8"),
        pytest.param((torch.int8, torch.bfloat16), id="int8-bf16"),
        pytest.param((torch.uint8, torch.float32), id="nf4"),
        pytest.param((torch.uint8, torch.bfloat16), id="nf4-bf16"),
    ],
    ids=str,
)
def test_a_layer_and_its_adapters_in_one_call_are_the_linear_then_shrink_expand(
    kernel, target, spread, slices, tokens, bias, weights
):
    """linear() gives, bit for bit, CpuLinear's y = x W^T + b with shrink_expand's products added
    (whose rounding the test above checks against PEFT's): outputs that are not a whole number of
    panels (40), a panel that straddles two slices (72, 24, 24), base-model tokens among the
    adapters' (every third, where there are several), segments longer than a task. int8 weights
    with a scale per output: (x W^T) * scale + b; NF4 weights (blocks of 64 inputs) with their
    absmax; both under fp32 or bf16 activations."""
    linear, why = CpuLinear.load(target=target)
    assert linear is not None, why
    weights, dtype = weights if isinstance(weights, tuple) else (weights, weights)  # the activations'
    inputs = 64 if weights == torch.uint8 else 40
    first_target, sizes = SLICES[slices]
    _, pool, _, table = case(spread, slices, 3 if tokens > 1 else 0, dtype, tokens, inputs, sizes)
    generator = torch.Generator().manual_seed(tokens)
    weight = torch.randn(sum(sizes), inputs, generator=generator).to(dtype)
    b = torch.randn(sum(sizes), generator=generator).to(dtype) if bias else None
    x = torch.randn(tokens, inputs, generator=generator).to(dtype)
    if weights == torch.uint8:
        runs = linear.runs_nf4(torch.zeros(1, dtype=weights), inputs, dtype)
    else:
        runs = linear.runs(torch.zeros(1, inputs, dtype=weights), dtype)
    if not runs:  # bf16 rows on a CPU without AVX512-BF16: their layers take torch's path
        pytest.skip(f"no {weights} linear kernel for {dtype} rows in this build (no AVX512-BF16)")
    if weights in (torch.int8, torch.uint8):
        panels, scale = _quantized_panels(linear, weight.float(), weights)
    else:
        panels, scale = linear.pack(weight), None
    step = kernel.step(table)
    assert kernel.runs_linear(panels, dtype)
    base = linear(x, panels, sum(sizes), b, scale)
    apart = step.shrink_expand(base, x, pool, first_target, sizes, UNIT)
    together = step.linear(x, panels, sum(sizes), b, pool, first_target, sizes, UNIT, scale=scale)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert together.shape == apart.shape and torch.equal(together.view(bits), apart.view(bits))


def _quantized_panels(linear: CpuLinear, weight: torch.Tensor, kind: torch.dtype) -> tuple:
    """(panels, scales) of weight [out, in] quantized to int8 (a scale per output) or, for
    torch.uint8, to NF4 (an absmax per 64 inputs)."""
    if kind == torch.int8:
        q, scale = quantize_int8_rows(weight)
        return linear.pack(q), scale
    return linear.pack_nf4(*quantize_nf4(weight), weight.shape[0])


@pytest.mark.parametrize("kind", [torch.int8, pytest.param(torch.uint8, id="nf4")], ids=str)
def test_quantized_layers_of_one_shape_each_take_their_own_scales(kernel, target, kind):
    """A step builds one call for every layer of a shape; an int8 or NF4 layer's scales are its
    own call's, not those of the first layer that shaped it (twice the weights: twice the
    scales)."""
    linear, why = CpuLinear.load(target=target)
    assert linear is not None, why
    first_target, sizes = SLICES[3]
    _, pool, _, table = case("uniform", 3, 0, torch.float32, 8, 64, sizes)
    step, generator = kernel.step(table), torch.Generator().manual_seed(7)
    x, weight = torch.randn(8, 64, generator=generator), torch.randn(sum(sizes), 64, generator=generator)
    for times in (1, 2):
        panels, scale = _quantized_panels(linear, times * weight, kind)
        base = linear(x, panels, sum(sizes), None, scale)
        apart = step.shrink_expand(base, x, pool, first_target, sizes, UNIT)
        together = step.linear(x, panels, sum(sizes), None, pool, first_target, sizes, UNIT, scale=scale)
        assert torch.equal(together.view(torch.int32), apart.view(torch.int32))


def test_a_steps_layer_calls_are_shaped_by_their_rows_and_bias(kernel, target):
    """A layer call's shape is built once a step, as shrink_expand's are: a later call of the
    step with more rows (base-model tokens after the adapters') or with a bias is shaped for its
    own, and still equals the linear then shrink_expand bit for bit; a bias of another dtype, and
    panels not laid out one after another, are refused, though calls of every other part of their
    shape ran before."""
    linear, why = CpuLinear.load(target=target)
    assert linear is not None, why
    first_target, sizes = SLICES[3]
    _, pool, _, table = case("uniform", 3, 0, torch.float32, 8, 40, sizes)
    step, generator = kernel.step(table), torch.Generator().manual_seed(7)
    panels = linear.pack(torch.randn(sum(sizes), 40, generator=generator))
    bias = torch.randn(sum(sizes), generator=generator)
    for rows, b in ((8, None), (11, None), (11, bias), (8, bias)):
        x = torch.randn(rows, 40, generator=generator)
        apart = step.shrink_expand(linear(x, panels, sum(sizes), b), x, pool, first_target, sizes, UNIT)
        together = step.linear(x, panels, sum(sizes), b, pool, first_target, sizes, UNIT)
        assert torch.equal(together.view(torch.int32), apart.view(torch.int32)), (rows, b is not None)
    with pytest.raises(AssertionError):
        step.linear(x, panels, sum(sizes), bias.double(), pool, first_target, sizes, UNIT)
    with pytest.raises(AssertionError):  # panels of the same shape, not laid out one after another
        strided = panels.transpose(1, 2).contiguous().transpose(1, 2)
        step.linear(x, strided, sum(sizes), bias, pool, first_target, sizes, UNIT)


def _assert_rounds_as_peft(out, y, x, pool, slots, adapters, first_target, sizes):
    """out, y plus each slice's LoRA product, against lora_ref within lora_bound, slice by slice."""
    offset = 0
    for s, size in enumerate(sizes):
        target, columns = first_target + s, slice(offset, offset + size)
        exact = lora_ref(y[:, columns].double(), x.double(), pool.double(), UNIT, slots, adapters, target)
        assert_within(out[:, columns], exact, lora_bound(y[:, columns], x, pool, slots, adapters, target))
        offset += size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_step_of_decodes_and_prefill_runs_takes_the_kernels_for_every_token(kernel, dtype):
    """The step as the engine mixes them: decodes of several adapters and one adapter's prefill
    chunk of RUN_ROWS + 5 tokens (which the torch path reads apart, in place) all go to the
    kernels, segments longer than a task's tokens among them; together they round as PEFT does."""
    first_target, sizes = SLICES[2]
    pool, adapters = paged_adapters(first_target, 40, sizes, dtype)  # NaN past each rank
    slots = [1, 2, -1, *[0] * (RUN_ROWS + 5), 3, *[2] * (RUN_ROWS - 1), -1, 2, 1]
    batch = LoraBatch.build(slots, adapters, cpu_lora=kernel)
    assert batch.rows is None and batch.table.tokens.numel() == len(slots) - 2
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(len(slots), 40, generator=generator).to(dtype)
    y = torch.randn(len(slots), sum(sizes), generator=generator).to(dtype)
    out = add_lora(y.clone(), x, batch, pool, UNIT, first_target, sizes)
    _assert_rounds_as_peft(out, y, x, pool, slots, adapters, first_target, sizes)


def test_a_steps_calls_are_checked_and_shaped_by_their_strides_and_dtypes(kernel):
    """A step builds and checks each call shape once, then its layers' calls pass only pointers:
    a call whose y has other strides (a view into wider rows) is shaped for them, not the first's,
    and one whose rows are not contiguous or whose dtype is not the pool's is refused, though a
    call of the same shape ran before."""
    first_target, sizes = SLICES[3]
    slots, pool, adapters, table = case("uniform", 3, 3, torch.float32, 8, 40, sizes)
    step = kernel.step(table)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(8, 40, generator=generator)
    y = torch.randn(8, sum(sizes), generator=generator)
    wide = torch.randn(8, sum(sizes) + 9, generator=generator)
    out, out_wide = y.clone(), wide.clone()
    step.shrink_expand(out, x, pool, first_target, sizes, UNIT)
    step.shrink_expand(out_wide[:, 4 : 4 + sum(sizes)], x, pool, first_target, sizes, UNIT)
    _assert_rounds_as_peft(out, y, x, pool, slots, adapters, first_target, sizes)
    inside = out_wide[:, 4 : 4 + sum(sizes)]
    _assert_rounds_as_peft(inside, wide[:, 4 : 4 + sum(sizes)], x, pool, slots, adapters, first_target, sizes)
    assert torch.equal(out_wide[:, :4], wide[:, :4]) and torch.equal(out_wide[:, -5:], wide[:, -5:])
    with pytest.raises(AssertionError):  # rows of x not contiguous
        step.shrink_expand(y.clone(), torch.randn(8, 80)[:, ::2], pool, first_target, sizes, UNIT)
    with pytest.raises(AssertionError):  # y of another dtype than x and the pool
        step.shrink_expand(y.double(), x, pool, first_target, sizes, UNIT)


def test_a_pool_of_another_dtype_is_refused(kernel):
    """The library reads the pool as x's dtype: a mismatch would read garbage, not fail."""
    first_target, sizes = SLICES[1]
    _, pool, _, table = case("uniform", 1, 3, torch.bfloat16, 8, 32, sizes)
    with pytest.raises(AssertionError):
        kernel.step(table).shrink(torch.randn(8, 32), pool, first_target, 1, UNIT)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_keeps_subnormal_outputs(kernel, dtype):
    """y plus a zero product is y, bit for bit, subnormals kept as torch's rounding keeps them:
    where no lane is subnormal, bf16 rounds in one instruction (vcvtneps2bf16) that reads them
    as zero."""
    first_target, sizes = SLICES[1]
    _, pool, _, table = case("uniform", 1, 3, dtype, 37, 72, sizes)
    tiny = torch.finfo(dtype).smallest_normal
    y = torch.randn(37, sizes[0]).mul(tiny / 4).to(dtype)  # [tokens, size] mostly subnormal
    y[y == 0] = tiny / 8  # no -0, which y + 0 makes +0
    y[::5] = torch.randn(sizes[0], dtype=dtype)  # rows of normal values beside them
    assert ((y.abs() < tiny) & (y != 0)).float().mean() > 0.5
    partials = torch.zeros(1, 37, 1, table.max_rank)
    out = kernel.step(table).expand(y.clone(), partials, pool, first_target, sizes, 72, UNIT)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), y.view(bits))


def reads_within_the_tokens_and_the_rows(target: str) -> None:
    """In a child (guard_pages.in_child), the kernel built for `target`: the step's last segment
    holds 2 tokens, a tile's part, at the end of the table's tokens; x's and y's last rows are a
    LoRA token's. A tile that read a token past its segment (rather than repeating its last), or a
    row past x or y, reads the page after them and faults."""
    kernel, why = CpuLora.load(target=target)
    assert kernel is not None, why
    first_target, sizes = SLICES[3]
    slots = [0, 1, 1, 2, 0, 1, 3, 2, 0, 1, 3]  # segments in the order of first use: adapter 3's last
    for dtype in DTYPES:
        pool, adapters = paged_adapters(first_target, 40, sizes, dtype)
        table = LoraBatch.build(slots, adapters, kernels=True).table
        assert table.lengths.tolist()[-1] == 2
        tokens = guarded(tuple(table.tokens.shape), torch.int32)
        tokens.copy_(table.tokens)
        step = kernel.step(dataclasses.replace(table, tokens=tokens))
        x, y = guarded((len(slots), 40), dtype), guarded((len(slots), sum(sizes)), dtype)
        x.copy_(torch.randn(x.shape))
        y.copy_(torch.randn(y.shape))
        out = step.shrink_expand(y.clone(), x, pool, first_target, sizes, UNIT)
        partials = step.shrink(x, pool, first_target, len(sizes), UNIT)
        shrink_close(partials, x, pool, slots, adapters, first_target, len(sizes))
        expanded = step.expand(y.clone(), partials, pool, first_target, sizes, 40, UNIT)
        expand_close(expanded, y, partials, pool, slots, adapters, first_target, sizes, 40, casts=3)
        _assert_rounds_as_peft(out, y, x, pool, slots, adapters, first_target, sizes)


def test_reads_nothing_past_the_tokens_or_the_rows(target):
    child = in_child(__name__, reads_within_the_tokens_and_the_rows.__name__, target)
    assert child.returncode == 0, f"return code {child.returncode}: {child.stderr[-2000:]}"

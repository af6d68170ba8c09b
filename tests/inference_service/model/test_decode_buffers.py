"""DecodeBuffers' LoRA table: a decode step written into the static buffers gives the LoRA
kernels (in Triton's interpreter here) the same result as the step's own LoraBatch (up to the
order of fp32 sums), in a bucket with padding rows, and whatever an earlier step left in the
buffers."""

import torch

from inference_service.model.decode_buffers import DecodeBuffers
from inference_service.model.forward_batch import SequenceInput
from kernels.lora_batch import PAGE_RANK, LoraBatch, SegmentTable
from kernels.lora_expand import lora_expand_ref, lora_expand_triton
from kernels.lora_shrink import BLOCK_K, lora_shrink_ref, lora_shrink_triton
from tests.kernels.paged_adapters import OTHER_RANK, TARGETS, UNIT, paged_adapters
from tests.kernels.rounding import assert_within, fp32_error, gamma

IN_FEATURES, SIZES = 64, (72, 24, 24)  # q/k/v: targets 0, 1, 2
MAX_ROWS = 8


def _qkv_lora(x: torch.Tensor, pool: torch.Tensor, table: SegmentTable) -> torch.Tensor:
    """The LoRA part of a qkv projection of x [rows, in]: [rows, sum(SIZES)]."""
    partials = lora_shrink_triton(x, pool, table, 0, len(SIZES), UNIT)
    y = x.new_zeros(x.shape[0], sum(SIZES))  # [rows, sum(SIZES)]
    return lora_expand_triton(y, partials, pool, table, 0, SIZES, IN_FEATURES, UNIT)


def _rounding_bound(x, pool, slots, adapters, table: SegmentTable) -> torch.Tensor:
    """How far an fp32 result of the qkv LoRA may land from the exact one: a term of it is one
    product of the shrink and in_features - 1 additions there, the additions of the splits' partial
    sums (a split takes BLOCK_K features at least), one product of the expand and max_rank additions
    there (y starts at 0)."""
    buf = lora_shrink_ref(x.abs(), pool.abs(), UNIT, slots, adapters, 0, len(SIZES))
    zeros = torch.zeros(len(slots), sum(SIZES), dtype=torch.float64)
    magnitude = lora_expand_ref(zeros, buf, pool.abs(), UNIT, slots, adapters, 0, SIZES, IN_FEATURES)
    roundings = IN_FEATURES + -(-IN_FEATURES // BLOCK_K) + 1 + table.max_rank
    return gamma(roundings * fp32_error(x.device)) * magnitude  # [rows, sum(SIZES)]


def test_a_decode_step_in_the_static_buffers_equals_its_lora_batch():
    torch.manual_seed(0)
    pool, adapters = paged_adapters(0, IN_FEATURES, SIZES, torch.float32)
    max_pages = -(-OTHER_RANK // PAGE_RANK)
    buffers = DecodeBuffers(MAX_ROWS, 2, 4, 9, None, TARGETS, max_pages, torch.device("cpu"))
    batches = {rows: buffers.batch(rows) for rows in (2, 4, MAX_ROWS)}  # built once, before any fill
    x = torch.randn(MAX_ROWS, IN_FEATURES)
    # later steps in smaller buckets, over what the first left; adapter 3 leaves q, k and v
    for rows, slots in ((MAX_ROWS, [2, -1, 0, 2, 3, 0, 1]), (4, [1, -1, 1]), (2, [0, 2])):
        buffers.fill([SequenceInput([7], 5, [3, 4], slot) for slot in slots], adapters)
        table = batches[rows].lora.table
        assert table.ranks.shape == (TARGETS, rows) and table.pages.shape == (TARGETS, rows, max_pages)
        got = _qkv_lora(x[:rows], pool, table)  # [rows, sum(SIZES)]
        own = LoraBatch.build(slots, adapters, kernels=True).table
        expected = _qkv_lora(x[: len(slots)], pool, own)
        # both within the bound of the exact value, so within twice it of each other
        assert_within(
            got[: len(slots)],
            expected.double(),
            2 * _rounding_bound(x[: len(slots)], pool, slots, adapters, own),
        )
        assert not got[len(slots) :].any()  # padding rows name no adapter
        assert expected.any()

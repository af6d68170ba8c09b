"""DecodeBuffers' LoRA table: a decode step written into the static buffers gives the LoRA
kernels (in Triton's interpreter here) the same result as the step's own LoraBatch, in a bucket
with padding rows, and whatever an earlier step left in the buffers."""

import torch

from inference_service.model.decode_buffers import DecodeBuffers
from inference_service.model.forward_batch import SequenceInput
from kernels.lora_batch import PAGE_RANK, LoraBatch, SegmentTable
from kernels.lora_expand import lora_expand_triton
from kernels.lora_shrink import lora_shrink_triton
from tests.kernels.paged_adapters import OTHER_RANK, TARGETS, UNIT, paged_adapters

IN_FEATURES, SIZES = 64, (72, 24, 24)  # q/k/v: targets 0, 1, 2
MAX_ROWS = 8


def _qkv_lora(x: torch.Tensor, pool: torch.Tensor, table: SegmentTable) -> torch.Tensor:
    """The LoRA part of a qkv projection of x [rows, in]: [rows, sum(SIZES)]."""
    partials = lora_shrink_triton(x, pool, table, 0, len(SIZES), UNIT)
    y = x.new_zeros(x.shape[0], sum(SIZES))  # [rows, sum(SIZES)]
    return lora_expand_triton(y, partials, pool, table, 0, SIZES, IN_FEATURES, UNIT)


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
        expected = _qkv_lora(x[: len(slots)], pool, LoraBatch.build(slots, adapters, kernels=True).table)
        torch.testing.assert_close(got[: len(slots)], expected)
        assert not got[len(slots) :].any()  # padding rows name no adapter
        assert expected.any()

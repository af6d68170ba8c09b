"""The Triton attention kernels on a GPU, Llama-3-8B shapes (32 query heads on 8 kv heads of 128,
blocks of 16 positions): decode attention's achieved bytes/s on the K/V it must read against
the device's measured copy bandwidth, over context and batch, side by side with the torch path
(blocks gathered into a padded tensor, then SDPA); then a few prefill steps, the varlen kernel
against one SDPA per chunk. Needs CUDA.

Times are replays of a CUDA graph holding 20 calls (the GPU's time without Python's launch
cost); `eager us` is the kernel launched from Python.

    .venv/bin/python -m bench.attention_kernels [--dtype bfloat16]
"""

import argparse
import random
from dataclasses import dataclass

import torch

from bench.cuda_timing import copy_bandwidth, cuda_seconds, graph_seconds
from inference_service.model.attention import AttentionMetadata, SequenceChunk, attend
from inference_service.model.kv_cache import KVCache
from kernels.paged_decode_attention import paged_decode_attention
from shared.dtypes import DTYPES

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CONTEXTS, BATCHES = (1024, 2048, 4096, 8192), (1, 8, 32, 64)
# (new tokens, cached positions) of every prefill chunk of a step
PREFILL_STEPS = (
    [(2048, 0)],
    [(512, 0)] * 8,
    [(512, 3072)] * 4,
    [(256, 0), (1024, 1024), (64, 7000), (700, 0)],
)


@dataclass(frozen=True)
class DecodeTiming:
    moved: int  # bytes the kernel must read: the K and V of every visible position
    ours: float  # seconds, paged_decode_attention alone, CUDA graph replay
    ours_eager: float  # seconds, paged_decode_attention alone, launched from Python
    ours_attend: float  # seconds, attend on the kernels' path (cache write included), graph replay
    torch_attend: float  # seconds, attend on the SDPA path, graph replay


def _step(new_and_cached: list[tuple[int, int]], dtype: torch.dtype):
    """A KV cache with every sequence's blocks scattered over it, the step's chunks, q, k and v."""
    sizes = [-(-(new + cached) // BLOCK_SIZE) for new, cached in new_and_cached]
    blocks = list(range(sum(sizes)))
    random.Random(0).shuffle(blocks)
    chunks, start = [], 0
    for (new, cached), size in zip(new_and_cached, sizes, strict=True):
        chunks.append(SequenceChunk(blocks[:size], cached, new, start))
        blocks, start = blocks[size:], start + new
    cache = KVCache(1, sum(sizes), BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, "cuda")
    cache.k.normal_()
    cache.v.normal_()
    q = torch.randn(start, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    k, v = (torch.randn(start, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(2))
    return cache, chunks, q, k, v


def _attend_seconds(step, kernels: bool) -> float:
    cache, chunks, q, k, v = step
    meta = AttentionMetadata.build(chunks, BLOCK_SIZE, None, "cuda", kernels=kernels)
    return graph_seconds(lambda: attend(q, k, v, cache, 0, meta, HEAD_DIM**-0.5))


def time_decode(batch: int, context: int, dtype: torch.dtype) -> DecodeTiming:
    step = _step([(1, context - 1)] * batch, dtype)
    cache, chunks, q, _, _ = step
    path = AttentionMetadata.build(chunks, BLOCK_SIZE, None, "cuda", kernels=True).path

    def ours():
        paged_decode_attention(
            q, cache.k[0], cache.v[0], path.decode_tables, path.decode_contexts, HEAD_DIM**-0.5, None
        )

    moved = batch * context * 2 * KV_HEADS * HEAD_DIM * cache.k.element_size()
    return DecodeTiming(
        moved,
        graph_seconds(ours),
        cuda_seconds(ours),
        _attend_seconds(step, True),
        _attend_seconds(step, False),
    )


def decode_attention_table(peak: float, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The decode rows, header first: bandwidth as a fraction of `peak` (copy_bandwidth())."""
    lines = ["context  batch   ours us   GB/s  of copy bw   eager us   attend: ours us  torch us  speed-up"]
    for context in CONTEXTS:
        for batch in BATCHES:
            t = time_decode(batch, context, dtype)
            torch.cuda.empty_cache()  # the largest steps' caches take GiBs
            rate = t.moved / t.ours
            lines.append(
                f"{context:7d}  {batch:5d}  {t.ours * 1e6:8.1f}  {rate / 1e9:5.0f}  {rate / peak:10.1%}  "
                f"{t.ours_eager * 1e6:9.1f}  {t.ours_attend * 1e6:16.1f}  {t.torch_attend * 1e6:8.1f}  "
                f"{t.torch_attend / t.ours_attend:8.2f}"
            )
    return lines


def prefill_attention_table(dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """attend over prefill-only steps, the varlen kernel against one SDPA per chunk, header first."""
    lines = [" ours us  TFLOP/s  torch us  speed-up  chunks (new tokens + cached positions)"]
    for chunks in PREFILL_STEPS:
        step = _step(chunks, dtype)
        ours, theirs = _attend_seconds(step, True), _attend_seconds(step, False)
        # q.k and p.v of every query over its cached positions and the causal triangle of its chunk
        flops = sum(4 * HEADS * HEAD_DIM * new * (cached + (new + 1) / 2) for new, cached in chunks)
        label = " ".join(f"{new}+{cached}" for new, cached in chunks)
        rate = flops / ours / 1e12
        lines.append(f"{ours * 1e6:8.1f}  {rate:7.1f}  {theirs * 1e6:8.1f}  {theirs / ours:8.2f}  {label}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the Triton kernels are benchmarked on a GPU only")
        return
    peak = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {peak / 1e9:.0f} GB/s, {args.dtype}")
    with torch.inference_mode():
        print("\n".join(decode_attention_table(peak, DTYPES[args.dtype])))
        print("\n".join(prefill_attention_table(DTYPES[args.dtype])))


if __name__ == "__main__":
    main()

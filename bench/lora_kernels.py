"""The Triton LoRA kernels on a GPU: achieved bytes/s of shrink + expand for decode batches
against the device's measured copy bandwidth, over batch size, distinct adapters and rank, side
by side with plain torch (each token's A and B pages gathered from the same adapter memory, then
bmm); then the engine's decode tokens/s with 8 rank-16 adapters against the base model. Also
prints bench.attention_kernels' decode table (paged decode attention against copy bandwidth).
Needs CUDA.

The adapters are paged as the engine pages them (kernels/lora_batch.py), on one hidden x hidden
target: each adapter's pages lie one after another in one layer's pool, a page per unit. Bytes
moved count x, y read and written, and the pages of the adapters the batch uses.

Kernel times are replays of a CUDA graph holding 20 calls, so they are the GPU's time without
Python's launch cost (which a serving step pays once per step under a graph); `eager us` is the
same pair launched from Python, as a step without a graph pays it.

    .venv/bin/python -m bench.lora_kernels [--hidden 4096] [--dtype bfloat16]
"""

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.attention_kernels import decode_attention_table
from bench.cache import default_model_dir
from bench.cuda_timing import copy_bandwidth, cuda_seconds, graph_seconds
from bench.engine_overhead import decode_rate
from bench.random_adapter import write_random_adapter
from inference_service.engine import Engine, EngineConfig
from kernels.lora_batch import PAGE_RANK, AdapterPages, LoraBatch, page_views
from kernels.lora_expand import lora_expand_triton
from kernels.lora_shrink import lora_shrink_triton
from shared.dtypes import DTYPES
from shared.errors import FailedPrecondition

BATCHES, ADAPTERS, RANKS = (1, 8, 32, 64, 128, 256), (1, 4, 16, 32), (8, 16, 32, 64)


@dataclass(frozen=True)
class KernelTiming:
    moved: int  # bytes the step must move: x, the pages of the adapters it uses, y read and written
    ours: float  # seconds, CUDA graph replay
    ours_eager: float  # seconds, launched from Python
    torch_gather_bmm: float  # seconds, CUDA graph replay


def paged_adapters(
    adapters: int, rank: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, dict[int, AdapterPages], int]:
    """(pool [units*unit], adapters by handle, unit): `adapters` random adapters of rank `rank` on
    one target (hidden in, hidden out), their pages one after another, one unit per page."""
    pages = -(-rank // PAGE_RANK)
    unit = PAGE_RANK * 2 * hidden  # elements of one page: A [PAGE_RANK, hidden], B^T [PAGE_RANK, hidden]
    pool = torch.randn(adapters * pages * unit, device="cuda", dtype=dtype)  # [units*unit]
    placed = {i: AdapterPages((rank,), (tuple(range(i * pages, (i + 1) * pages)),)) for i in range(adapters)}
    return pool, placed, unit


def time_kernels(batch: int, adapters: int, rank: int, hidden: int, dtype: torch.dtype) -> KernelTiming:
    slots = [i % adapters for i in range(batch)]
    pool, placed, unit = paged_adapters(adapters, rank, hidden, dtype)
    table = LoraBatch.build(slots, placed, "cuda").table
    x = torch.randn(batch, hidden, device="cuda", dtype=dtype)
    y = torch.randn(batch, hidden, device="cuda", dtype=dtype)
    a, b = page_views(pool, unit, hidden, hidden)  # [units, PAGE_RANK, hidden] each
    index = torch.tensor([placed[s].pages[0] for s in slots], device="cuda")  # [batch, pages]

    def ours():
        partials = lora_shrink_triton(x, pool, table, 0, 1, unit)
        lora_expand_triton(y, partials, pool, table, 0, (hidden,), hidden, unit)

    def gather_bmm():  # [batch, 1, hidden] @ [batch, hidden, rank] @ [batch, rank, hidden]
        a_rows = a[index].flatten(1, 2)[:, :rank]  # [batch, rank, hidden]
        b_rows = b[index].flatten(1, 2)[:, :rank]  # [batch, rank, hidden]
        buf = torch.bmm(x[:, None, :], a_rows.transpose(1, 2))  # [batch, 1, rank]
        y.add_(torch.bmm(buf, b_rows)[:, 0])

    pages = sum(len(placed[s].pages[0]) for s in set(slots))
    moved = (x.numel() + 2 * y.numel() + pages * unit) * x.element_size()
    return KernelTiming(moved, graph_seconds(ours), cuda_seconds(ours), graph_seconds(gather_bmm))


def engine_overhead() -> tuple[float, float]:
    model_dir = default_model_dir()
    config = EngineConfig(model=str(model_dir), device="cuda", max_loras=8, max_lora_rank=16, max_cpu_loras=8)
    engine = Engine(config)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(8):
            folder = write_random_adapter(engine.model_config, Path(tmp) / f"r16-{i}", 16, seed=i)
            engine.add_adapter(folder.name, folder)
        with torch.inference_mode():
            rates = {}
            for name, adapters in {"base": [None] * 32, "lora": [f"r16-{i % 8}" for i in range(32)]}.items():
                decode_rate(engine, adapters, 32, 32)  # warm-up
                rates[name] = statistics.median(decode_rate(engine, adapters, 32, 32) for _ in range(3))
    return rates["base"], rates["lora"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the Triton kernels are benchmarked on a GPU only")
        return
    peak = copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}: copy bandwidth {peak / 1e9:.0f} GB/s, "
        f"hidden {args.hidden}, {args.dtype}"
    )
    print("batch  adapters  rank   ours us  GB/s  of copy bw   torch gather+bmm us  speed-up   eager us")
    started = time.perf_counter()
    for batch in BATCHES:
        for adapters in ADAPTERS:
            for rank in RANKS:
                t = time_kernels(batch, adapters, rank, args.hidden, DTYPES[args.dtype])
                rate = t.moved / t.ours
                print(
                    f"{batch:5d}  {adapters:8d}  {rank:4d}  {t.ours * 1e6:8.1f}  {rate / 1e9:4.0f}  "
                    f"{rate / peak:10.1%}   {t.torch_gather_bmm * 1e6:19.1f}  "
                    f"{t.torch_gather_bmm / t.ours:8.2f}  {t.ours_eager * 1e6:9.1f}"
                )
    print("decode attention, Llama-3-8B shape (bench.attention_kernels):")
    with torch.inference_mode():
        print("\n".join(decode_attention_table(peak, DTYPES[args.dtype])))
    try:
        base, lora = engine_overhead()
    except FailedPrecondition as error:  # a GPU machine without the default model's wheel
        print(f"engine decode tok/s, default model: not measured: {error}")
        return
    print(
        f"engine decode tok/s, default model, 32 requests: base {base:.1f}, 8 rank-16 adapters {lora:.1f}, "
        f"ratio {lora / base:.3f} ({time.perf_counter() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()

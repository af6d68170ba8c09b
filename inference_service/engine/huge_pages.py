"""huge_pages: a CPU worker's weights, adapter memory and KV cache moved onto 2 MiB pages once they
are loaded (Linux 6.1's MADV_COLLAPSE, whatever the system's transparent-huge-page setting).

A decode step reads every weight once. On 4 KiB pages that is a TLB miss every 4 KiB, and a
hardware prefetch stream that ends at every page's end; on 2 MiB pages the default model's decode
steps took 0.87 to 0.99 of the time (bf16 and fp32 at batches 1 and 8, with adapters and without;
two engines side by side in one process, the gain moving with the machine's state). Where the
kernel cannot move them (before 6.1, not Linux) nothing changes but the speed, and the worker's
log says why.

A worker's memory is mostly there already: its entry point advises torch's allocator to ask for
2 MiB pages from the first write (shared/huge_page_advice.py), and collapsing memory already on
them costs nothing. What is left is what the kernel would not back that way (transparent huge
pages off) or what a process allocated without the advice (an engine in a caller's process).
"""

import ctypes
import os
import sys
from collections.abc import Iterable

import torch

MADV_COLLAPSE = 25  # <linux/mman.h>
HUGE_PAGE = 2 << 20


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> str:
    """Asks the kernel to back the memory of each strided CPU tensor's storage with 2 MiB pages
    (the whole huge pages inside it: a storage under 4 MiB may hold none); says how much moved,
    and why where some did not."""
    if sys.platform != "linux":
        return f"none on 2 MiB pages: MADV_COLLAPSE is Linux's, not {sys.platform}'s"
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    moved, refused = 0, set()
    for start, end in _huge_spans(tensors):
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            moved += end - start
        else:
            refused.add(os.strerror(ctypes.get_errno()))
    said = f"{moved / 2**20:.0f} MiB on 2 MiB pages"
    return said + (f" (the kernel refused the rest: {', '.join(sorted(refused))})" if refused else "")


def _huge_spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) of the 2 MiB-aligned part of each distinct storage of the strided CPU tensors."""
    strided = (t.untyped_storage() for t in tensors if t.device.type == "cpu" and t.layout == torch.strided)
    storages = {storage.data_ptr(): storage.nbytes() for storage in strided}
    spans = (
        (-(-start // HUGE_PAGE) * HUGE_PAGE, (start + size) // HUGE_PAGE * HUGE_PAGE)
        for start, size in storages.items()
    )
    return sorted((start, end) for start, end in spans if end > start)

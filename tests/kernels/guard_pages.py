"""Tensors that end where the process may not read: the page after a tensor's last byte is mapped
with no access, so a kernel that reads even one element past its end faults where a read into
padding or NaN rows would pass unseen (a prefetch's address, a row past a partial group whose
result is dropped). A fault ends the process, so such checks run in one of their own (in_child).
"""

import ctypes
import math
import mmap
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PROT_NONE = 0  # mprotect's: no access (Python's mmap names only PROT_READ and PROT_WRITE)


def guarded(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zero tensor of `shape` whose last byte is the last before a page with no access."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = -(-size // mmap.PAGESIZE)
    region = mmap.mmap(-1, (pages + 1) * mmap.PAGESIZE)  # anonymous, zero-filled
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    guard = ctypes.c_void_p(start + pages * mmap.PAGESIZE)
    if libc.mprotect(guard, ctypes.c_size_t(mmap.PAGESIZE), PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect of the guard page failed")
    end = pages * mmap.PAGESIZE
    return torch.frombuffer(region, dtype=torch.uint8)[end - size : end].view(dtype).view(shape)


def in_child(module: str, function: str, *args: str) -> subprocess.CompletedProcess:
    """Runs module.function(*args) in a fresh interpreter at the repo root; a fault shows as a
    return code of -SIGSEGV, a failed assertion as 1 with its traceback in stderr."""
    return subprocess.run(
        [sys.executable, "-c", f"from {module} import {function}; {function}(*{list(args)!r})"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )

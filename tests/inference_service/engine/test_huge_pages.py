"""A CPU worker's tensors moved onto 2 MiB pages (inference_service/engine/huge_pages.py), as
/proc/self/smaps shows them, their values kept."""

import mmap
import platform
import sys
from pathlib import Path

import pytest
import torch

from inference_service.engine.huge_pages import HUGE_PAGE, move_to_huge_pages

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or tuple(map(int, platform.release().split(".")[:2])) < (6, 1),
    reason="MADV_COLLAPSE needs Linux 6.1",
)


def mapping_entry(address: int, key: str) -> list[str]:
    """The values of `key` ("AnonHugePages:", "VmFlags:") for the mapping holding `address`, from
    /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == key:
            return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`."""
    return int(mapping_entry(address, "AnonHugePages:")[0]) * 1024


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    THP.is_file() and "[always]" in THP.read_text(), reason="THP always: pages may be huge already"
)
def test_a_tensors_whole_huge_pages_move_and_keep_their_values():
    # 6 MiB of fresh memory, on 4 KiB pages: a tensor from torch's allocator may reuse memory an
    # engine built earlier in this process already moved
    region = mmap.mmap(-1, 3 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    weights = torch.frombuffer(region, dtype=torch.float32)  # two whole huge pages inside, wherever it lies
    weights.copy_(torch.randn(weights.numel(), generator=torch.Generator().manual_seed(0)))
    before, last = weights.clone(), weights.data_ptr() + weights.nbytes - 1
    huge_before = huge_bytes_at(last)
    said = move_to_huge_pages([weights, weights[1:]])  # a view's storage counted once
    start = weights.data_ptr()
    inside = ((start + weights.nbytes) // HUGE_PAGE - -(-start // HUGE_PAGE)) * HUGE_PAGE
    assert said == f"{inside / 2**20:.0f} MiB on 2 MiB pages" and inside >= 2 * HUGE_PAGE
    assert huge_bytes_at(last) - huge_before == inside
    assert torch.equal(weights, before)


def test_tensors_off_the_cpu_or_too_small_to_hold_a_huge_page_are_left():
    assert move_to_huge_pages([torch.zeros(1000), torch.zeros(8, device="meta")]) == "0 MiB on 2 MiB pages"

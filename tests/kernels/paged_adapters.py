"""Random adapters in paged adapter memory, for the LoRA kernel tests: mixed ranks per target
(0: the adapter leaves the target; ranks that end inside a page), pages out of order with gaps
between them, in a pool that is a view into its storage as one layer's pool is."""

import math
import random

import torch

from kernels.lora_batch import PAGE_RANK, AdapterPages, page_width

TARGETS = 7  # q, k, v, o, gate, up, down
UNIT = 64  # elements per unit: smaller than every test page, and it divides them all
# each adapter's rank on the tested targets, in slice order (0: the adapter leaves the target)
RANKS = ((8, 3, 17), (17, 0, 5), (1, 24, 0), (0, 0, 9))
OTHER_RANK = 33  # each adapter's rank on the target after the tested ones: more pages than any tested
POOL_OFFSET = 5  # elements of storage before the pool


def paged_adapters(
    first_target: int,
    in_features: int,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    fill: float = math.nan,
    gathered: int = 1,
) -> tuple[torch.Tensor, dict[int, AdapterPages]]:
    """(pool [units*UNIT], adapters by handle): the RANKS adapters on targets first_target + s,
    with A rows of in_features and B^T rows of sizes[s] (`gathered` blocks of them per page, as a
    fully sharded column layer's rank holds), random weights. Every other element of
    the pool holds `fill` (NaN: a read the kernels must not make shows in their output), rows
    past an adapter's rank in its last page included; each adapter's OTHER_RANK pages of the
    target after the tested ones all lie at unit 0, which holds only `fill`."""
    generator = torch.Generator().manual_seed(first_target * 100 + len(sizes))
    place_units = max(
        -(-page_width(in_features, n, gathered) // UNIT) for n in sizes
    )  # room for any tested page
    places = list(range(1, 2 * sum(_pages(r) for ranks in RANKS for r in ranks[: len(sizes)]) + 1))
    random.Random(len(places)).shuffle(places)  # twice the places needed: gaps; place 0 stays `fill`
    elements = (len(places) + 1) * place_units * UNIT
    pool = torch.full((POOL_OFFSET + elements,), fill, dtype=dtype, device=device)[POOL_OFFSET:]
    other = (first_target + len(sizes)) % TARGETS
    adapters = {}
    for handle, ranks in enumerate(RANKS):
        target_ranks, target_pages = [0] * TARGETS, [()] * TARGETS
        target_ranks[other], target_pages[other] = OTHER_RANK, (0,) * _pages(OTHER_RANK)
        for s, size in enumerate(sizes):
            rank = ranks[s]
            units = tuple(places.pop() * place_units for _ in range(_pages(rank)))
            for g, u in enumerate(units):
                rows = min(PAGE_RANK, rank - g * PAGE_RANK)
                _write_page(pool[u * UNIT :], rows, in_features, size, gathered, generator)
            target_ranks[first_target + s], target_pages[first_target + s] = rank, units
        adapters[handle] = AdapterPages(tuple(target_ranks), tuple(target_pages))
    return pool, adapters


def _pages(rank: int) -> int:
    return -(-rank // PAGE_RANK)


def _write_page(page: torch.Tensor, rows: int, in_features: int, size: int, gathered: int, generator) -> None:
    """Random A and B^T in the first `rows` rank rows of the page starting at page[0] (of each of
    its `gathered` blocks of B^T rows)."""
    page[: rows * in_features] = torch.randn(rows * in_features, generator=generator)
    for block in range(gathered):
        start = PAGE_RANK * in_features + block * PAGE_RANK * size
        page[start : start + rows * size] = torch.randn(rows * size, generator=generator)

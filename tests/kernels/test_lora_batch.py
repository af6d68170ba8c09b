from kernels.lora_batch import TILE_ROWS, AdapterPages, LoraBatch

# three adapters on targets 0 and 1 of two targets: ranks 8 (1 page), 20 (3 pages), 0 on target 1
ADAPTERS = {
    0: AdapterPages((8, 8), ((10,), (50,))),
    1: AdapterPages((20, 20), ((12, 30, 14), (52, 60, 56))),
    2: AdapterPages((16, 0), ((40, 20), ())),
}


def test_page_rows_give_every_token_each_page_of_its_adapter_once():
    slots = [1, 0, -1, 1, 1, 2, 1, 1]  # adapter 1 has 5 tokens, the others 1: chunks of 3 rows
    batch = LoraBatch.build(slots, ADAPTERS)
    rows = batch.rows[0]
    assert rows.rows == 3  # ceil(7 tokens / 3 adapters)
    got: dict[int, list[int]] = {}
    units, gather, scatter = rows.units.tolist(), rows.gather.tolist(), rows.scatter.tolist()
    for i, (token, target) in enumerate(zip(gather, scatter, strict=True)):
        page = units[i // rows.rows]
        if token == len(slots):  # padding: the zero row, added to a token of the same adapter
            assert page in ADAPTERS[slots[target]].pages[0]
        else:
            assert token == target
            got.setdefault(token, []).append(page)
    expected = {t: sorted(ADAPTERS[s].pages[0]) for t, s in enumerate(slots) if s >= 0}
    assert {t: sorted(p) for t, p in got.items()} == expected
    assert len(gather) <= 2 * sum(len(p) for p in expected.values())  # padding stays under 2x


def test_a_target_no_adapter_of_the_step_has_costs_nothing():
    batch = LoraBatch.build([2, -1, 2], ADAPTERS)
    assert batch.rows[0] is not None and batch.rows[1] is None
    assert LoraBatch.build([-1, -1], ADAPTERS).rows == (None, None)


def test_kernel_tiles_cover_every_lora_token_once_and_no_tile_is_empty():
    # a 40-token prefill on adapter 0, three decodes on adapters 1, 2 and 1, base-model tokens between
    slots = [0] * 40 + [-1, 1, 2, -1, 1]
    table = LoraBatch.build(slots, ADAPTERS, kernels=True).table
    assert table.num_tiles == 3 + 2  # 40 rows in tiles of 16, 16, 8; one tile per decode segment
    tokens, starts, lengths = table.tokens.tolist(), table.starts.tolist(), table.lengths.tolist()
    covered = []
    for segment, row in zip(table.tile_segments.tolist(), table.tile_rows.tolist(), strict=True):
        assert 0 <= row < lengths[segment]  # a tile starts inside its segment: never idle
        end = min(row + TILE_ROWS, lengths[segment])
        covered += tokens[starts[segment] + row : starts[segment] + end]
    assert sorted(covered) == [i for i, s in enumerate(slots) if s >= 0]
    assert table.ranks.tolist() == [[8, 20, 16], [8, 20, 0]]
    assert table.pages[0, 1].tolist() == [12, 30, 14] and table.max_rank == 24

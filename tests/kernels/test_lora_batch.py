from kernels.lora_batch import TILE_ROWS, LoraBatch


def test_batch_build_keeps_grouped_order_and_sorts_scattered():
    grouped = LoraBatch.build([2, 2, -1, 0, 0, 0])
    assert grouped.order is None
    assert [(s.slot, s.start, s.end) for s in grouped.segments] == [(2, 0, 2), (0, 3, 6)]

    scattered = LoraBatch.build([1, 0, 1, -1])
    assert scattered.order.tolist() == [3, 1, 0, 2]
    assert [(s.slot, s.start, s.end) for s in scattered.segments] == [(0, 1, 2), (1, 2, 4)]


def test_padded_layout_maps_every_token_to_its_slot_rows():
    batch = LoraBatch.build([2, 2, -1, 0, 3, 3, 3], max_pad_factor=4)
    layout = batch.padded
    assert (layout.first_slot, layout.num_slots, layout.rows) == (0, 4, 3)
    gather = layout.gather.tolist()
    for token, slot in enumerate([2, 2, -1, 0, 3, 3, 3]):
        row = layout.scatter[token].item()
        if slot < 0:
            assert row == layout.num_slots * layout.rows
        else:
            assert row // layout.rows == slot and gather[row] == token


def test_decode_steps_pad_and_a_long_prefill_beside_decodes_loops_over_slots():
    decode = [i % 8 for i in range(32)]
    assert LoraBatch.build(decode).padded is not None
    prefill_and_decodes = [0] * 200 + list(range(1, 8))
    assert LoraBatch.build(prefill_and_decodes).padded is None


def test_kernel_tiles_cover_every_lora_token_once_and_no_tile_is_empty():
    # a 40-token prefill on slot 0, three decodes on slots 1-3, base-model tokens between
    slots = [0] * 40 + [-1, 1, 2, -1, 3]
    table = LoraBatch.build(slots, kernels=True).table
    assert table.num_tiles == 3 + 3  # 40 rows in tiles of 16, 16, 8; one tile per decode
    tokens, starts, lengths = table.tokens.tolist(), table.starts.tolist(), table.lengths.tolist()
    covered = []
    for segment, row in zip(table.tile_segments.tolist(), table.tile_rows.tolist(), strict=True):
        assert 0 <= row < lengths[segment]  # a tile starts inside its segment: never idle
        end = min(row + TILE_ROWS, lengths[segment])
        covered += tokens[starts[segment] + row : starts[segment] + end]
    assert sorted(covered) == [i for i, s in enumerate(slots) if s >= 0]

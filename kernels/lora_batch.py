"""Per-step LoRA metadata: which adapter slot every token of the flattened batch uses."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """Rows [start, end) of the slot-grouped batch all use adapter `slot`."""

    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class LoraBatch:
    """Built once per step from the token->slot mapping and reused by every LoRA layer.

    Semantics: token i of the flattened batch uses adapter slot token_slots[i]; slot -1 means
    the base model alone. `order` lists token indices grouped by slot (None when the batch
    already holds each slot's tokens in one contiguous run, as the engine arranges it);
    `segments` are the runs of that grouped order, slot -1 runs left out.
    """

    token_slots: torch.Tensor  # [tokens] int64
    order: torch.Tensor | None  # [tokens] int64, or None when already grouped
    segments: tuple[Segment, ...]

    @classmethod
    def build(cls, token_slots: list[int], device: torch.device | str = "cpu") -> "LoraBatch":
        runs = _runs(token_slots)
        lora_runs = [r for r in runs if r.slot >= 0]
        grouped = len(lora_runs) == len({r.slot for r in lora_runs})
        slots = torch.tensor(token_slots, dtype=torch.int64, device=device)  # [tokens]
        if grouped:
            return cls(slots, None, tuple(lora_runs))
        order = sorted(range(len(token_slots)), key=token_slots.__getitem__)
        sorted_runs = _runs([token_slots[i] for i in order])
        order_t = torch.tensor(order, dtype=torch.int64, device=device)  # [tokens]
        return cls(slots, order_t, tuple(r for r in sorted_runs if r.slot >= 0))


def _runs(slots: list[int]) -> list[Segment]:
    runs: list[Segment] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            runs.append(Segment(slots[start], start, i))
            start = i
    return runs

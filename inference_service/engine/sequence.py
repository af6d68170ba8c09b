"""Sequence: the engine's state of one request, from admission to finish."""

import enum
from dataclasses import dataclass, field

import torch

from inference_service.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted: no KV blocks, no slot
    RUNNING = "running"  # admitted: holds KV blocks and (with an adapter) a slot reference
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    slot: int = -1
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # seeded requests sample from their own stream

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_len(self) -> int:
        """The most positions this sequence can ever occupy in the KV cache."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)

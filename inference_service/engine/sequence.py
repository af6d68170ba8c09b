"""Sequence: the engine's state of one request, from admission to finish."""

import enum
from dataclasses import dataclass, field

import torch

from inference_service.engine.logit_adds import OutputPenalties, SparseRow, bias_row, early_bias
from inference_service.engine.request import Request
from inference_service.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted: no KV blocks, no slot
    RUNNING = "running"  # admitted: holds KV blocks and (with an adapter) a slot reference
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    # The adapter content it runs on, from its submission (or first admission) to its end,
    # whatever the name serves later; None without an adapter, or until bound.
    digest: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache (from the prefix cache or computed)
    block_table: list[int] = field(default_factory=list)
    slot: int = -1
    status: Status = Status.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # seeded requests sample from their own stream
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    preemptions: int = 0  # times its blocks were taken back and it waited again
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, as far as known
    named_blocks: int = 0  # its first blocks that are in the prefix cache under their hash
    hit_blocks: int = 0  # its first blocks that came from the prefix cache at this admission
    # A constrained request's grammar matcher (engine/grammars.py), at the end of its output
    matcher: object | None = None
    bias: SparseRow | None = None  # its logit bias (engine/logit_adds.py)
    early_bias: SparseRow | None = None  # the same with its ends banned, before its output holds min_tokens
    penalties: OutputPenalties | None = None  # its presence and frequency penalties, as its output grows

    @classmethod
    def of(
        cls,
        request: Request,
        generator: torch.Generator | None,
        digest: str | None,
        matcher: object | None,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
    ):
        """A submitted request's sequence: its own generator (seeded requests), grammar matcher
        (constrained ones) and logit bias and penalties (where it asks for them) for its whole
        life, and the adapter content it keeps; `eos_token_ids` are among the ends min_tokens
        bans, those of its vocabulary of `vocab_size` tokens."""
        params, adapter = request.params, request.adapter
        prompt, bias = list(request.prompt_token_ids), bias_row(params)
        return cls(
            request.request_id,
            prompt,
            params,
            adapter,
            digest,
            generator=generator,
            matcher=matcher,
            bias=bias,
            early_bias=early_bias(bias, params, eos_token_ids, vocab_size),
            penalties=OutputPenalties.of(params),
        )

    @property
    def step_bias(self) -> SparseRow | None:
        """Its logit bias at this step: with its ends banned while its output is short of min_tokens."""
        return self.early_bias if len(self.output_token_ids) < self.params.min_tokens else self.bias

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        """More than one token to compute: a prompt, or all it had before a preemption."""
        return self.num_tokens - self.num_computed > 1

"""Greedy tokens in bf16 against transformers + PEFT's own bf16 run, where its run has no near tie.

Two bf16 implementations of one model round differently, so where a step's top two logits lie
closer together than bf16's rounding moves them, either token is a right answer. PEFT's bf16 run
shows how far that is at each step: the same prefix through its fp32 model gives the margin that
bf16 rounded. A step is a near tie when its bf16 margin is at most twice its error (another
implementation, erring as far the other way, could pick the second token). Each request's tokens
are compared up to its first near tie, and the requests cut there are counted.
"""

from dataclasses import dataclass

import torch

from bench.hf_peft import Job


@dataclass(frozen=True)
class GreedyPath:
    """A request's greedy tokens from PEFT's bf16 run, and the first step that is a near tie."""

    tokens: list[int]
    tie: int | None  # None: no step is

    @property
    def compared(self) -> int:
        """Tokens before the first near tie: those another implementation must match."""
        return len(self.tokens) if self.tie is None else self.tie

    def agrees(self, ours: list[int]) -> bool:
        """Whether `ours` follows this path up to its first near tie."""
        return ours[: self.compared] == self.tokens[: self.compared]


def greedy_paths(low: torch.nn.Module, high: torch.nn.Module, jobs: list[Job]) -> list[GreedyPath]:
    """Each job's greedy path under `low` (the bf16 model), its margins checked against `high`'s
    (the fp32 model, same adapters) on the same prefixes. Jobs run one at a time, unpadded."""
    return [_path(low, high, job) for job in jobs]


def _path(low: torch.nn.Module, high: torch.nn.Module, job: Job) -> GreedyPath:
    ids, tokens, tie = list(job.prompt), [], None
    kwargs = {"adapter_names": [job.adapter]} if job.adapter else {}
    for step in range(job.tokens):
        batch = torch.tensor([ids])
        logits = low(input_ids=batch, **kwargs).logits[0, -1].double()  # [vocab]
        exact = high(input_ids=batch, **kwargs).logits[0, -1].double()  # [vocab]
        top = logits.topk(2).indices
        margin = logits[top[0]] - logits[top[1]]
        error = (margin - (exact[top[0]] - exact[top[1]])).abs()
        if tie is None and margin <= 2 * error:
            tie = step
        tokens.append(int(logits.argmax()))  # as generate picks: the first of equal logits
        ids.append(tokens[-1])
    return GreedyPath(tokens, tie)

"""A step's sampling: one token per sequence from its row of the logits, its constraint's mask
applied first (engine/grammars.py), then sampled as its SamplingParams ask (engine/sampler.py),
with the history, logit bias and penalties its row needs."""

import torch

from inference_service.engine.grammars import mask_rows
from inference_service.engine.sampler import SampleResult, SamplingBatch, sample
from inference_service.engine.sequence import Sequence
from kernels.cpu_token_mask import CpuTokenMask


def sample_sequences(
    seqs: list[Sequence], logits: torch.Tensor, mask_kernel: CpuTokenMask | None
) -> SampleResult:
    """One token per sequence from its row of `logits` [seqs, vocab]; constrained rows masked by
    `mask_kernel` where there is one (mask_rows)."""
    # Only penalized rows read their history; building it costs O(length) per row.
    histories = [s.token_ids if s.params.repetition_penalty != 1 else [] for s in seqs]
    penalties = [s.penalties.row() if s.penalties is not None else None for s in seqs]
    batch = SamplingBatch.build(
        [s.params for s in seqs],
        [s.generator for s in seqs],
        histories,
        [s.step_bias for s in seqs],
        penalties,
        logits.device,
    )
    return sample(mask_rows(logits, [s.matcher for s in seqs], mask_kernel), batch)

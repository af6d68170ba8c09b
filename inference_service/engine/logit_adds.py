"""What a request adds to a few entries of its logits at each step: its logit bias, fixed for its
life (its ends banned too, before its output holds min_tokens), and its presence and frequency
penalties (OpenAI's: -(frequency × count + presence) at each token its output holds so far), kept
up to date as each token joins the output. The sampler reads a row's entries as they stand, never
counting the output again: a step costs O(rows), not O(every row's output)."""

from dataclasses import dataclass

import numpy as np

from inference_service.sampling import SamplingParams

FIRST_CAPACITY = 64  # entries an output's penalties start with room for; doubled as it grows


@dataclass(frozen=True)
class SparseRow:
    """Values added at some token ids of one row of logits."""

    ids: np.ndarray  # [n] int64
    values: np.ndarray  # [n] float32


def bias_row(params: SamplingParams) -> SparseRow | None:
    """The request's logit bias; None without one."""
    if not params.logit_bias:
        return None
    ids, values = zip(*params.logit_bias, strict=True)
    return SparseRow(np.array(ids, dtype=np.int64), np.array(values, dtype=np.float32))


def early_bias(
    own: SparseRow | None, params: SamplingParams, eos_token_ids: tuple[int, ...], vocab_size: int
) -> SparseRow | None:
    """The logit bias of a request's first min_tokens tokens: its own (`own`, bias_row's), and its
    ends banned (its stop token ids, and EOS unless it ignores EOS); `own` where it bans none. A
    stop token id past the vocabulary is never drawn: there is no logit to ban."""
    stops = {i for i in params.stop_token_ids if i < vocab_size}
    ends = stops | (set() if params.ignore_eos else set(eos_token_ids))
    if not (params.min_tokens and ends):
        return own
    ids = np.array(sorted(ends), dtype=np.int64)  # [e]
    banned = SparseRow(ids, np.full(len(ids), -np.inf, dtype=np.float32))
    if own is None:
        return banned
    return SparseRow(np.concatenate([own.ids, banned.ids]), np.concatenate([own.values, banned.values]))


class OutputPenalties:
    """One request's presence and frequency penalties at the tokens of its output so far."""

    def __init__(self, presence: float, frequency: float):
        self._presence, self._frequency = presence, frequency
        self._where: dict[int, int] = {}  # token id -> its entry
        self._ids = np.empty(FIRST_CAPACITY, dtype=np.int64)
        self._counts = np.empty(FIRST_CAPACITY, dtype=np.int64)

    @classmethod
    def of(cls, params: SamplingParams) -> "OutputPenalties | None":
        if not (params.presence_penalty or params.frequency_penalty):
            return None
        return cls(params.presence_penalty, params.frequency_penalty)

    def add(self, token: int) -> None:
        """The output holds one more `token`."""
        entry = self._where.get(token)
        if entry is None:
            entry = self._where[token] = len(self._where)
            if entry == len(self._ids):
                self._ids, self._counts = np.resize(self._ids, 2 * entry), np.resize(self._counts, 2 * entry)
            self._ids[entry], self._counts[entry] = token, 0
        self._counts[entry] += 1

    def row(self) -> SparseRow | None:
        """The penalties as they stand (ids a view, valid until the next add); None before any token."""
        n = len(self._where)
        if not n:
            return None
        values = -(self._frequency * self._counts[:n] + self._presence)  # [n] float64, then rounded once
        return SparseRow(self._ids[:n], values.astype(np.float32))

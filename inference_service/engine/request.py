"""Request, Delta, RequestOutput: what callers hand the engine and what they get back."""

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from inference_service.engine.sampler import TokenLogprobs
from inference_service.sampling import SamplingParams
from shared.errors import InvalidArgument, LoramuxError


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    adapter: str | None = None  # a registered adapter name; None = base model
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def check(self, max_model_len: int, vocab_size: int, has_tokenizer: bool) -> None:
        """Refuse a request no model of this shape could serve. Cheap checks come first: the
        token scan is O(prompt)."""
        params, prompt = self.params, self.prompt_token_ids
        if not prompt:
            raise InvalidArgument("prompt_token_ids is empty")
        if len(prompt) + params.max_tokens > max_model_len:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {max_model_len}"
            )
        if params.min_tokens > params.max_tokens:
            raise InvalidArgument(
                f"min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})"
            )
        if params.stop and not has_tokenizer:
            raise InvalidArgument("stop strings need a tokenizer; this model folder has no tokenizer.json")
        if params.structured and not has_tokenizer:
            raise InvalidArgument(
                "structured outputs need a tokenizer; this model folder has no tokenizer.json"
            )
        biased = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
        if biased is not None:
            raise InvalidArgument(f"logit_bias token id {biased} is outside the vocabulary [0, {vocab_size})")
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class Delta:
    """What one step added to one request. The last delta has finish_reason set (and usage);
    a request that failed ends with `error` instead of tokens."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: LoramuxError | None = None
    cached_tokens: int = 0  # of prompt_tokens, those found in the prefix cache
    preemptions: int = 0  # times the request gave its KV blocks back and was computed again

    @classmethod
    def join(cls, deltas: list["Delta"]) -> "Delta":
        """One delta for consecutive deltas of one request: their tokens, text and logprobs in
        order; finish, usage and error of the last."""
        if len(deltas) == 1:
            return deltas[0]
        last = deltas[-1]
        return cls(
            last.request_id,
            [t for d in deltas for t in d.token_ids],
            "".join(d.text for d in deltas),
            [lp for d in deltas for lp in d.logprobs],
            last.finish_reason,
            last.prompt_tokens,
            last.completion_tokens,
            last.error,
            last.cached_tokens,
            last.preemptions,
        )


Sink = Callable[[Delta], None]  # takes a request's deltas as its steps end


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs]
    error: LoramuxError | None = None
    cached_tokens: int = 0
    preemptions: int = 0

    @classmethod
    def collect(cls, deltas: list[Delta]) -> "RequestOutput":
        d = Delta.join(deltas)
        return cls(
            d.request_id,
            d.token_ids,
            d.text,
            d.finish_reason,
            d.prompt_tokens,
            d.completion_tokens,
            d.logprobs,
            d.error,
            d.cached_tokens,
            d.preemptions,
        )

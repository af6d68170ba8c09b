"""What the SDK returns: plain dataclasses, free of protobuf types."""

from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple


class TopLogprob(NamedTuple):
    """One alternative token at a position."""

    token_id: int
    logprob: float
    token_bytes: bytes  # the bytes of text it stands for (part of a UTF-8 character for some)


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one generated token and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[TopLogprob]  # most likely first
    token_bytes: bytes = b""  # the bytes of text the token stands for


@dataclass(frozen=True)
class Delta:
    """What one engine step added: new token ids and the text they complete."""

    token_ids: list[int]
    text: str  # never splits a UTF-8 character, never contains a stop string
    logprobs: list[TokenLogprob]  # one per token when logprobs were asked for, else empty


@dataclass(frozen=True)
class Completion:
    """A finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "length", "stop" or "abort"
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_s: float
    total_s: float
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens: int = 0  # of prompt_tokens, those the worker found in its prefix cache
    request_id: str = ""  # the request_id the call sent, echoed by the worker
    worker_request_id: str = ""  # the worker's id for the request, as its log lines name it


@dataclass(frozen=True)
class Adapter:
    """An adapter registered in the store."""

    adapter_id: str
    digest: str  # "sha256:<hex>" of the optimized blob: its content identity
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    dtype: str
    source_uri: str
    pinned: bool
    created: datetime | None  # UTC


@dataclass(frozen=True)
class WorkerAdapter:
    """An adapter a worker holds right now."""

    adapter_id: str
    digest: str  # empty while loading
    location: str  # "device", "host" or "loading"
    pinned: bool


@dataclass(frozen=True)
class ModelInfo:
    """The model a worker serves and its limits."""

    model_name: str
    model_type: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    eos_token_ids: list[int]
    has_chat_template: bool
    quantization: str = "none"  # the linear layers' base weights: "none", "int8" or "nf4"
    linear_weight_bytes: int = 0  # what those weights take, in their format
    num_experts: int = 0  # a mixture-of-experts model's experts per layer (0: dense)
    experts_per_token: int = 0  # how many of them each token runs
    tensor_parallel_size: int = 1  # ranks the model is split over
    # How the chat template teaches the model to call tools: "hermes", "qwen3_xml", "glm45",
    # "llama3_json", "mistral", or "" when it does not (a chat's tools are still shown to the model
    # where its template renders them).
    tool_call_format: str = ""
    # The special token that opens a reply's calls, in formats that have one (mistral's [TOOL_CALLS]).
    tool_call_token_id: int | None = None
    # How the chat template has the model reason: "think" (the model opens <think>), "think_opened"
    # (the generation prompt opens it), or "" (no reasoning block).
    reasoning_format: str = ""
    # Whether a chat request's output constraint holds the reasoning block too (the worker's
    # --constrain-reasoning); False: the block's text is free and the constraint holds what follows.
    constrains_reasoning: bool = False

"""Proto <-> domain conversion for the InferenceService, in one place (a request's prompt: prompt.py)."""

from dataclasses import replace
from pathlib import Path

from inference_service.engine import AdapterState, Delta, Engine, EngineStats, Request
from inference_service.engine.histogram import Histogram
from inference_service.engine.tokenizer import Tokenizer
from inference_service.sampling import SamplingParams, Structured
from inference_service.server.prompt import prompt_ids
from shared.errors import InvalidArgument
from shared.names import check_adapter_id
from shared.pb.loramux.inference.v1 import inference_pb2 as pb

MAX_REQUEST_ID_CHARS = 256  # a label for the caller's logs; longer than any id scheme writes
OPTIONAL_SAMPLING = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "skip_special_tokens",
)
FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "abort": pb.FINISH_REASON_ABORT,
}
LOCATIONS = {
    "device": pb.ADAPTER_LOCATION_DEVICE,
    "host": pb.ADAPTER_LOCATION_HOST,
    "loading": pb.ADAPTER_LOCATION_LOADING,
}


def request(
    message: pb.GenerateRequest,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    worker_request_id: str,
    constrain_reasoning: bool = False,
) -> Request:
    """The engine's request, keyed by the worker's own id. The cheap checks come first and the
    prompt is tokenized last, in time proportional to a prompt already bounded by `max_model_len`.
    The client's request_id is a label only (logged, and echoed in Final), so no caller can
    collide with another's. A chat reply's constraint follows the template's reasoning block,
    unless `constrain_reasoning` (EngineConfig's) or the chat renders no generation prompt."""
    label = message.request_id
    if len(label) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id is {len(label)} characters long; at most {MAX_REQUEST_ID_CHARS}")
    adapter = check_adapter_id(message.adapter) if message.adapter else None
    params = sampling(message.sampling)
    prompt = prompt_ids(message, tokenizer, max_model_len)
    reasoning = tokenizer.reasoning_format if tokenizer and not constrain_reasoning else ""
    if params.structured and reasoning and _opens_a_reply(message):
        params = replace(params, structured=replace(params.structured, after_reasoning=reasoning))
    if message.sampling.max_tokens_to_limit and not message.sampling.HasField("max_tokens"):
        params = replace(params, max_tokens=max(max_model_len - len(prompt), 1))
    return Request(prompt, adapter, params, worker_request_id)


def _opens_a_reply(message: pb.GenerateRequest) -> bool:
    """Whether the prompt is a chat rendered with its generation prompt, where a thinking model's
    reply opens with its reasoning (a continued final message goes on as it was)."""
    chat = message.chat
    opened = not (chat.continue_final_message or chat.omit_generation_prompt)
    return message.WhichOneof("input") == "chat" and opened


def sampling(message: pb.SamplingParams) -> SamplingParams:
    given = {name: getattr(message, name) for name in OPTIONAL_SAMPLING if message.HasField(name)}
    return SamplingParams(
        **given,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        logit_bias=tuple(sorted(message.logit_bias.items())),
        ignore_eos=message.ignore_eos,
        include_stop_str_in_output=message.include_stop_str_in_output,
        logprobs=message.logprobs,
        structured=structured(message),
    )


def structured(message: pb.SamplingParams) -> Structured | None:
    kind = message.WhichOneof("structured")
    if kind is None:
        return None
    if kind == "json_object":
        if not message.json_object:
            raise InvalidArgument("sampling.json_object, when set, must be true")
        return Structured("json_object")
    if kind == "choice":
        return Structured("choice", choices=tuple(message.choice.choices))
    return Structured(kind, getattr(message, kind))


def delta(d: Delta, tokenizer: Tokenizer | None) -> pb.GenerateResponse:
    spell = tokenizer.token_bytes if tokenizer is not None else lambda _: b""
    logprobs = [
        pb.TokenLogprob(
            token_id=token,
            logprob=lp.logprob,
            token_bytes=spell(token),
            top=[pb.TopLogprob(token_id=t, logprob=p, token_bytes=spell(t)) for t, p in lp.top],
        )
        for token, lp in zip(d.token_ids, d.logprobs, strict=False)
    ]
    return pb.GenerateResponse(delta=pb.Delta(token_ids=d.token_ids, text=d.text, logprobs=logprobs))


def final(d: Delta, label: str, first_token_s: float, total_s: float) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        final=pb.Final(
            finish_reason=FINISH_REASONS[d.finish_reason],
            usage=pb.Usage(
                prompt_tokens=d.prompt_tokens,
                completion_tokens=d.completion_tokens,
                cached_tokens=d.cached_tokens,
            ),
            timings=pb.Timings(time_to_first_token_s=first_token_s, total_s=total_s),
            request_id=label,
            worker_request_id=d.request_id,
        )
    )


def adapters(states: list[AdapterState]) -> pb.ListAdaptersResponse:
    return pb.ListAdaptersResponse(
        adapters=[
            pb.WorkerAdapter(
                adapter_id=s.name, digest=s.digest, location=LOCATIONS[s.location], pinned=s.pinned
            )
            for s in states
        ]
    )


def model_info(engine: Engine) -> pb.ModelInfo:
    config, model = engine.config, engine.model_config
    tokenizer = engine.tokenizer
    return pb.ModelInfo(
        model_name=Path(config.model).name,
        model_type=model.model_type,
        vocab_size=model.vocab_size,
        max_model_len=engine.max_model_len,
        dtype=config.dtype,
        quantization=engine.quantization,
        linear_weight_bytes=engine.linear_weight_bytes,
        device=config.device,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        adapter_memory_bytes=engine.memory.stats().bytes_total,
        eos_token_ids=tokenizer.eos_token_ids if tokenizer else model.eos_token_ids,
        has_chat_template=tokenizer is not None and tokenizer.has_chat_template,
        num_experts=model.moe.num_experts if model.moe else 0,
        experts_per_token=model.moe.top_k if model.moe else 0,
        tensor_parallel_size=config.tensor_parallel_size,
        tool_call_format=tokenizer.tool_call_format if tokenizer else "",
        tool_call_token_id=tokenizer.tool_call_token_id if tokenizer else None,
        reasoning_format=tokenizer.reasoning_format if tokenizer else "",
        constrains_reasoning=config.constrain_reasoning,
    )


def stats(snapshot: EngineStats, in_flight: int) -> pb.Stats:
    load, host, slots, scheduler, grammars = (
        snapshot.adapter_load_seconds,
        snapshot.host_tier,
        snapshot.slots,
        snapshot.scheduler,
        snapshot.grammars,
    )
    return pb.Stats(
        requests=[
            pb.RequestCount(adapter_id=adapter, outcome=outcome, count=count)
            for (adapter, outcome), count in sorted(snapshot.requests.items())
        ],
        prompt_tokens=snapshot.prompt_tokens,
        generation_tokens=snapshot.generation_tokens,
        waiting=scheduler.waiting,
        running=scheduler.running,
        in_flight=in_flight,
        kv_blocks_used=scheduler.kv_blocks_used,
        kv_blocks_total=scheduler.kv_blocks_total,
        kv_blocks_cached=scheduler.kv_blocks_cached,
        num_preemptions=scheduler.preemptions,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        active_slots=slots.active,
        slot_activations=slots.activations,
        slot_evictions=slots.evictions,
        host_hits=host.hits,
        host_misses=host.misses,
        host_evictions=host.evictions,
        host_adapters=host.size,
        adapter_load_seconds=_histogram(load),
        host_request_hits=host.request_hits,
        host_request_misses=host.request_misses,
        adapter_memory_used_bytes=slots.bytes_used,
        adapter_memory_total_bytes=slots.bytes_total,
        ranks=[
            pb.RankMemory(
                rank=r.rank,
                weight_bytes=r.weight_bytes,
                adapter_memory_bytes=r.adapter_memory_bytes,
                kv_cache_bytes=r.kv_cache_bytes,
            )
            for r in snapshot.ranks
        ],
        collective_seconds=snapshot.collective_seconds,
        structured_requests=grammars.requests,
        grammar_cache_hits=grammars.hits,
        grammar_compile_seconds=_histogram(grammars.compile_seconds),
    )


def _histogram(h: Histogram) -> pb.Histogram:
    return pb.Histogram(bounds=h.buckets, counts=h.counts, sum=h.total, count=h.count)

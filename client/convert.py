"""Requests built from Python arguments and responses turned into SDK dataclasses: the one place
both clients share, so the sync and async clients differ only in how they wait."""

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any

from google.protobuf.message import Message as Proto

from shared.pb.loramux.inference.v1 import inference_pb2 as inference_pb
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb

from .types import Adapter, Completion, Delta, ModelInfo, TokenLogprob, TopLogprob, WorkerAdapter

SAMPLING_FIELDS = tuple(inference_pb.SamplingParams.DESCRIPTOR.fields_by_name)
# The output constraints: SamplingParams' oneof, so a request carries at most one.
STRUCTURED = tuple(
    field.name for field in inference_pb.SamplingParams.DESCRIPTOR.oneofs_by_name["structured"].fields
)
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
TOOL_CALL_KEYS = ("id", "type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")

Message = Mapping[str, Any] | tuple[str, str]
Tool = Mapping[str, Any]


@dataclass(frozen=True)
class Rpc:
    """One unary call: which service and method, its request, and how to read its reply."""

    service: str  # "worker" or "store"
    method: str
    request: Proto
    decode: Callable[[Any], Any]


def register_adapter_rpc(adapter_id: str, source_uri: str, request_id: str | None) -> Rpc:
    request = store_pb.RegisterAdapterRequest(
        adapter_id=adapter_id, source_uri=source_uri, request_id=request_id or ""
    )
    return Rpc("store", "RegisterAdapter", request, adapter)


def get_adapter_rpc(adapter_id: str) -> Rpc:
    return Rpc("store", "GetAdapter", store_pb.GetAdapterRequest(adapter_id=adapter_id), adapter)


def list_adapters_rpc(page_size: int, page_token: str) -> Rpc:
    """Decodes to (this page's adapters, the next page's token or "")."""
    request = store_pb.ListAdaptersRequest(page_size=page_size, page_token=page_token)
    return Rpc("store", "ListAdapters", request, adapter_page)


def delete_adapter_rpc(adapter_id: str, force: bool) -> Rpc:
    request = store_pb.DeleteAdapterRequest(adapter_id=adapter_id, force=force)
    return Rpc("store", "DeleteAdapter", request, lambda response: adapter(response.adapter))


def pin_adapter_rpc(adapter_id: str) -> Rpc:
    return Rpc("store", "PinAdapter", store_pb.PinAdapterRequest(adapter_id=adapter_id), adapter)


def unpin_adapter_rpc(adapter_id: str) -> Rpc:
    return Rpc("store", "UnpinAdapter", store_pb.UnpinAdapterRequest(adapter_id=adapter_id), adapter)


def worker_adapters_rpc() -> Rpc:
    return Rpc("worker", "ListAdapters", inference_pb.ListAdaptersRequest(), worker_adapters)


def model_info_rpc() -> Rpc:
    return Rpc("worker", "GetModelInfo", inference_pb.GetModelInfoRequest(), model_info)


@dataclass(frozen=True)
class ChatOptions:
    """What goes with messages alone."""

    tools: Sequence[Tool] | None = None
    template_kwargs: dict | None = None  # more variables for the chat template
    continue_final_message: bool = False  # the reply continues the final message, left open
    add_generation_prompt: bool = True  # False: the prompt ends with the last message's turn


def generate_request(
    prompt: str | None,
    token_ids: Iterable[int] | None,
    messages: Sequence[Message] | None,
    chat: ChatOptions,
    adapter: str | None,
    request_id: str | None,
    sampling: dict,
) -> inference_pb.GenerateRequest:
    """A GenerateRequest; ValueError unless exactly one input is given (chat options only with
    messages), TypeError for an unknown sampling argument.

    A message is {"role", "content"} or (role, content), or OpenAI's assistant message with
    "tool_calls" or tool message with "tool_call_id" (and "name"); `chat.tools` are OpenAI's
    {"type": "function", "function": {"name", "description", "parameters"}} or the bare function,
    shown to the model by its chat template; `chat.template_kwargs` more variables for that
    template, such as {"enable_thinking": False} (vLLM's chat_template_kwargs);
    `chat.continue_final_message` renders the final message open, so the reply continues it (an
    answer begun for the model), with no generation prompt; `chat.add_generation_prompt` False
    renders none either (transformers' and vLLM's two options).

    `sampling` takes SamplingParams' fields: max_tokens, min_tokens, temperature, top_k, top_p, min_p,
    repetition_penalty, presence_penalty, frequency_penalty, logit_bias ({token id: bias}), seed,
    stop, stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output, logprobs,
    max_tokens_to_limit;
    and at most one output constraint (ValueError naming them when more are given): json_schema
    (a dict or its JSON text), json_object=True (any JSON object), regex (the whole output
    matches it), choice (a list of strings: the output is one of them) or grammar (Lark, or
    GBNF). A constraint the worker cannot compile is InvalidArgument. None leaves an argument
    unset."""
    given = [name for name, value in _inputs(prompt, token_ids, messages) if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, token_ids or messages (got {given or 'none'})")
    if chat != ChatOptions() and messages is None:
        raise ValueError(
            "tools, chat_template_kwargs, continue_final_message and add_generation_prompt go with "
            "messages: a chat template takes them, a prompt cannot"
        )
    request = inference_pb.GenerateRequest(
        adapter=adapter or "", request_id=request_id or "", sampling=sampling_params(sampling)
    )
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.messages.extend(chat_message(m, f"messages[{i}]") for i, m in enumerate(messages))
        request.chat.tools.extend(tool(t, f"tools[{i}]") for i, t in enumerate(chat.tools or ()))
        if chat.template_kwargs is not None:
            request.chat.template_kwargs = _json_text(chat.template_kwargs, "chat_template_kwargs")
        request.chat.continue_final_message = chat.continue_final_message
        request.chat.omit_generation_prompt = not chat.add_generation_prompt
    return request


def _inputs(prompt, token_ids, messages) -> list[tuple[str, object]]:
    return [("prompt", prompt), ("token_ids", token_ids), ("messages", messages)]


def sampling_params(sampling: dict) -> inference_pb.SamplingParams:
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown sampling arguments {unknown}; known: {', '.join(SAMPLING_FIELDS)}")
    values = {name: value for name, value in sampling.items() if value is not None}
    if isinstance(values.get("stop"), str):  # a lone string, not its characters
        values["stop"] = [values["stop"]]
    constraint = structured({name: values.pop(name) for name in STRUCTURED if name in values})
    return inference_pb.SamplingParams(**values, **constraint)


def structured(given: dict) -> dict:
    """The structured-output keywords given (None already dropped) as SamplingParams' oneof takes
    them: at most one, since the worker applies a single constraint; json_object=False is none."""
    if given.get("json_object") is False:
        del given["json_object"]
    if len(given) > 1:
        raise ValueError(f"give at most one output constraint, got {', '.join(given)}")
    return {name: _constraint(name, value) for name, value in given.items()}


def _constraint(name: str, value: Any) -> Any:
    """One structured-output keyword's value as its oneof field holds it; TypeError for a value of
    the wrong kind, rather than protobuf's message that names no keyword."""
    if name == "json_schema":
        return _json_text(value, name)
    if name == "choice":
        return _choices(value)
    if name == "json_object":
        if value is not True:
            raise TypeError(f"json_object is True or False, got {value!r}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} takes a str, got {type(value).__name__}")
    return value


def _choices(choices: Sequence[str]) -> inference_pb.Choices:
    if isinstance(choices, str):  # a lone string would otherwise become its characters
        raise TypeError(f"choice takes a sequence of strings, not one string: choice=[{choices!r}]")
    choices = list(choices)
    if not all(isinstance(c, str) for c in choices):
        raise TypeError(f"choice takes strings, got {choices!r}")
    return inference_pb.Choices(choices=choices)


def chat_message(message: Message, where: str) -> inference_pb.ChatMessage:
    """{"role": ..., "content": ...} or (role, content) -> ChatMessage; a dict may also be OpenAI's
    assistant message with "tool_calls" (its content None or absent) and "reasoning_content" (a
    thinking model's, sent back), or a tool message with "tool_call_id" and an optional "name"."""
    if isinstance(message, tuple) and len(message) == 2:
        return inference_pb.ChatMessage(role=message[0], content=message[1])
    if not isinstance(message, Mapping):
        raise ValueError(
            f"{where}: a chat message is a {{'role', 'content'}} dict or a (role, content) tuple, "
            f"got {message!r}"
        )
    _check_keys(message, MESSAGE_KEYS, where)
    content = message.get("content")
    if "role" not in message or (content is None and not message.get("tool_calls")):
        raise ValueError(f"{where}: a chat message needs 'role' and 'content', got keys {sorted(message)}")
    calls = enumerate(message.get("tool_calls") or ())
    return inference_pb.ChatMessage(
        role=message["role"],
        content=content or "",
        tool_calls=[tool_call(c, f"{where}.tool_calls[{j}]") for j, c in calls],
        tool_call_id=message.get("tool_call_id") or "",
        name=message.get("name") or "",
        reasoning_content=message.get("reasoning_content") or "",
    )


def tool_call(call: Mapping, where: str) -> inference_pb.ToolCall:
    """OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}; arguments JSON text
    (sent as is: the worker names a call whose text is not a JSON object), a dict to dump, or absent
    for none ({})."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or "name" not in function:
        raise ValueError(f"{where}: a tool call needs 'function': {{'name', 'arguments'}}, got {call!r}")
    _check_keys(call, TOOL_CALL_KEYS, where)
    _check_function_type(call, where)
    _check_keys(function, ("name", "arguments"), f"{where}.function")
    arguments = _json_text(function.get("arguments", {}), f"{where}.function.arguments")
    return inference_pb.ToolCall(id=call.get("id") or "", name=function["name"], arguments=arguments)


def tool(spec: Tool, where: str) -> inference_pb.Tool:
    """OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}, or that
    function alone; parameters (a JSON schema) as a dict or JSON text, absent for any object.
    OpenAI's "strict" is taken and has no effect: the worker shows tools to the chat template, it
    does not constrain the calls the model writes."""
    if "function" in spec:
        _check_keys(spec, ("type", "function"), where)
        _check_function_type(spec, where)
        spec, where = spec["function"], f"{where}.function"
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ValueError(f"{where}: a tool needs a 'name', got {spec!r}")
    _check_keys(spec, FUNCTION_KEYS, where)
    parameters = spec.get("parameters")
    return inference_pb.Tool(
        name=spec["name"],
        description=spec.get("description") or "",
        parameters="" if parameters is None else _json_text(parameters, f"{where}.parameters"),
    )


def _check_keys(mapping: Mapping, known: Sequence[str], where: str) -> None:
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; known: {', '.join(known)}")


def _check_function_type(spec: Mapping, where: str) -> None:
    if spec.get("type", "function") != "function":
        raise ValueError(f"{where}: type {spec['type']!r} is not 'function', the only kind of tool")


def _json_text(value: Mapping | str, where: str) -> str:
    """A dict dumped as compact JSON, or a str taken as JSON text already (the worker parses it)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return json.dumps(value, separators=(",", ":"))
    raise TypeError(f"{where} takes a dict or its JSON text, got {type(value).__name__}")


def delta(message: inference_pb.Delta) -> Delta:
    return Delta(
        token_ids=list(message.token_ids),
        text=message.text,
        logprobs=[token_logprob(entry) for entry in message.logprobs],
    )


def token_logprob(message: inference_pb.TokenLogprob) -> TokenLogprob:
    top = [TopLogprob(alt.token_id, alt.logprob, alt.token_bytes) for alt in message.top]
    return TokenLogprob(message.token_id, message.logprob, top, message.token_bytes)


def completion(deltas: list[Delta], final: inference_pb.Final) -> Completion:
    """The whole generation: every delta joined, with the Final message's reason, usage, timings."""
    return Completion(
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        finish_reason=_enum_word(inference_pb.FinishReason, final.finish_reason, "FINISH_REASON_"),
        prompt_tokens=final.usage.prompt_tokens,
        completion_tokens=final.usage.completion_tokens,
        cached_tokens=final.usage.cached_tokens,
        time_to_first_token_s=final.timings.time_to_first_token_s,
        total_s=final.timings.total_s,
        logprobs=[lp for d in deltas for lp in d.logprobs],
        request_id=final.request_id,
        worker_request_id=final.worker_request_id,
    )


def adapter(message: store_pb.Adapter) -> Adapter:
    created = message.create_time.ToDatetime(tzinfo=UTC) if message.HasField("create_time") else None
    return Adapter(
        adapter_id=message.adapter_id,
        digest=message.digest,
        rank=message.rank,
        alpha=message.alpha,
        target_modules=list(message.target_modules),
        size_bytes=message.size_bytes,
        dtype=message.dtype,
        source_uri=message.source_uri,
        pinned=message.pinned,
        created=created,
    )


def adapter_page(message: store_pb.ListAdaptersResponse) -> tuple[list[Adapter], str]:
    return [adapter(a) for a in message.adapters], message.next_page_token


def worker_adapters(message: inference_pb.ListAdaptersResponse) -> list[WorkerAdapter]:
    return [
        WorkerAdapter(
            adapter_id=a.adapter_id,
            digest=a.digest,
            location=_enum_word(inference_pb.AdapterLocation, a.location, "ADAPTER_LOCATION_"),
            pinned=a.pinned,
        )
        for a in message.adapters
    ]


def model_info(message: inference_pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_name=message.model_name,
        model_type=message.model_type,
        vocab_size=message.vocab_size,
        max_model_len=message.max_model_len,
        dtype=message.dtype,
        quantization=message.quantization,
        linear_weight_bytes=message.linear_weight_bytes,
        device=message.device,
        max_loras=message.max_loras,
        max_lora_rank=message.max_lora_rank,
        max_cpu_loras=message.max_cpu_loras,
        eos_token_ids=list(message.eos_token_ids),
        has_chat_template=message.has_chat_template,
        num_experts=message.num_experts,
        experts_per_token=message.experts_per_token,
        tensor_parallel_size=message.tensor_parallel_size or 1,
        tool_call_format=message.tool_call_format,
        tool_call_token_id=message.tool_call_token_id if message.HasField("tool_call_token_id") else None,
        reasoning_format=message.reasoning_format,
        constrains_reasoning=message.constrains_reasoning,
    )


def _enum_word(enum, value: int, prefix: str) -> str:
    """FINISH_REASON_STOP -> "stop"; a value this SDK does not know yet -> its number."""
    try:
        return enum.Name(value).removeprefix(prefix).lower()
    except ValueError:
        return str(value)

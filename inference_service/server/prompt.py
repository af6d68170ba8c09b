"""The prompt of a GenerateRequest as token ids: token ids as given, text tokenized, or a chat
rendered by the model's template with its tool calls, tool results, tools and template variables.
Every text is bounded before it is parsed or tokenized."""

import json

from inference_service.engine.tokenizer import Tokenizer
from shared.errors import InvalidArgument
from shared.pb.loramux.inference.v1 import inference_pb2 as pb

MAX_TOOLS = 128  # OpenAI's bound on the functions one request may offer


def prompt_ids(message: pb.GenerateRequest, tokenizer: Tokenizer | None, max_model_len: int) -> list[int]:
    kind = message.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("GenerateRequest has no input: set text, token_ids or chat")
    if kind == "token_ids":
        ids = message.token_ids.ids
        if len(ids) > max_model_len:  # before the engine looks at each id
            raise InvalidArgument(f"prompt has {len(ids)} token ids; max_model_len is {max_model_len}")
        return list(ids)
    if tokenizer is None:
        raise InvalidArgument(f"this model has no tokenizer, so {kind} input cannot be used; send token_ids")
    if kind == "text":
        text = message.text
        _check_prompt_bytes("text prompt", _utf8_bytes(text), tokenizer, max_model_len)
        return tokenizer.encode(text)
    rendered = _chat_prompt(message.chat, tokenizer, max_model_len)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _chat_prompt(chat: pb.ChatInput, tokenizer: Tokenizer, max_model_len: int) -> str:
    """The chat rendered by the model's template, with its tool calls, tool results and tools; the
    texts are bounded before any JSON in them is parsed."""
    messages = chat.messages
    if not messages:
        raise InvalidArgument("chat input has no messages")
    if len(messages) > max_model_len:  # every chat template writes at least one token per message
        raise InvalidArgument(
            f"chat input has {len(messages)} messages; max_model_len is {max_model_len} tokens"
        )
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidArgument(f"chat input has {len(chat.tools)} tools; at most {MAX_TOOLS}")
    texts = [text for m in messages for text in _message_texts(m)]
    texts += [text for t in chat.tools for text in (t.name, t.description, t.parameters)]
    texts.append(chat.template_kwargs)
    size = sum(_utf8_bytes(text) for text in texts)
    _check_prompt_bytes("chat input (messages and tools)", size, tokenizer, max_model_len)
    tools = [_tool(t, f"chat.tools[{i}]") for i, t in enumerate(chat.tools)] or None
    rendered = [_message(m, f"chat.messages[{i}]") for i, m in enumerate(messages)]
    kwargs = _json_object(chat.template_kwargs, "chat.template_kwargs") if chat.template_kwargs else None
    return tokenizer.apply_chat_template(
        rendered,
        add_generation_prompt=not chat.omit_generation_prompt,
        tools=tools,
        template_kwargs=kwargs,
        continue_final_message=chat.continue_final_message,
    )


def _message_texts(m: pb.ChatMessage) -> list[str]:
    calls = [text for c in m.tool_calls for text in (c.id, c.name, c.arguments)]
    return [m.role, m.content, m.tool_call_id, m.name, m.reasoning_content, *calls]


def _message(m: pb.ChatMessage, where: str) -> dict:
    """A chat message as chat templates take it (transformers' form): tool calls' arguments parsed."""
    message = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = enumerate(m.tool_calls)
        message["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    if m.reasoning_content:
        message["reasoning_content"] = m.reasoning_content
    return message


def _tool_call(c: pb.ToolCall, where: str) -> dict:
    arguments = _json_object(c.arguments, f"{where}.arguments")
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}}


def _tool(t: pb.Tool, where: str) -> dict:
    if not t.name:
        raise InvalidArgument(f"{where} has no name")
    function = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = _json_object(t.parameters, f"{where}.parameters") if t.parameters else {}
    return {"type": "function", "function": function}


def _json_object(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # the text is bounded above, its nesting is not
        raise InvalidArgument(f"{where} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} is not a JSON object")
    return value


def _utf8_bytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))  # isascii() is O(1)


def _check_prompt_bytes(what: str, size: int, tokenizer: Tokenizer, max_model_len: int) -> None:
    """Refuses, without tokenizing it, a prompt too long to fit max_model_len tokens whatever its text."""
    bound = max_model_len * tokenizer.max_token_bytes
    if size > bound:
        raise InvalidArgument(
            f"{what} is {size} bytes; at most {bound} bytes can fit max_model_len {max_model_len} "
            f"tokens (no token of this model stands for more than {tokenizer.max_token_bytes} bytes)"
        )

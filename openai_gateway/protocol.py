"""The request bodies the gateway accepts, as pydantic models, and the parameters it refuses.

OpenAI refuses arguments it does not know ("Unrecognized request argument supplied: x"); so do we,
and we also refuse the OpenAI parameters we do not implement unless they hold their neutral value,
so a request never gets silently different sampling than it asked for. top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, min_tokens, skip_special_tokens,
include_stop_str_in_output and (chat) chat_template_kwargs,
continue_final_message and add_generation_prompt are accepted as extensions (vLLM's extra_body).
"""

from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .config import MAX_N
from .errors import ApiError, invalid_body

MAX_LOGPROBS = 20  # the worker's bound on alternatives per token
MAX_LOGIT_BIAS = 1024  # the worker's bound on the tokens one request may bias
MAX_TOOLS = 128  # OpenAI's bound on the functions one request may offer
INT32_MAX = (1 << 31) - 1  # token ids, max_tokens and top_k are int32 in the worker's proto
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Bias = Annotated[float, Field(ge=-100, le=100)]  # added to a token's logit
# OpenAI parameters that are accepted only at a value that changes nothing.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),  # deprecated by OpenAI for `tools`
    "function_call": (None, "none"),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "web_search_options": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
}


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class Closed(BaseModel):
    """A body part that refuses keys it does not know, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(Closed):
    model_config = ConfigDict(populate_by_name=True)
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")  # {}: any JSON value
    strict: bool | None = None  # the output always follows the whole schema, strict or not


class ResponseFormat(Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ApiError(
                400,
                "`response_format.json_schema` goes with, and only with, type json_schema",
                "response_format",
            )
        return self


class StructuredOutputs(Closed):
    """vLLM's extension: one constraint on the output."""

    json_: dict | str | None = Field(None, alias="json")  # a JSON schema, or its JSON text
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None  # Lark, or GBNF (::= rules)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name, value in self.fields_given().items() if value]
        if len(given) != 1:
            raise ApiError(
                400,
                f"`structured_outputs` takes exactly one of json, regex, choice, grammar or json_object "
                f"(got {', '.join(given) or 'none'})",
                "structured_outputs",
            )
        return self

    def fields_given(self) -> dict:
        return {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
        }


class StreamOptions(Closed):
    include_usage: bool | None = None


class Sampling(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")  # extras are checked against NEUTRAL below

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    # token id (a string key in JSON) -> bias; the worker refuses ids past its vocabulary
    logit_bias: Annotated[dict[TokenId, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user label; nothing here acts on it
    # Extensions, as vLLM takes them.
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Output constraints: OpenAI's, and vLLM's extension.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name not in NEUTRAL:
                raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name)
            if value not in NEUTRAL[name]:
                raise ApiError(
                    400, f"`{name}` is not supported by this server (only {NEUTRAL[name][-1]!r})", name
                )
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "`stream_options` is only allowed when `stream` is true", "stream_options")
        return self

    @property
    def prompt_count(self) -> int:
        """Prompts in the request (a chat is one), each sampled n times."""
        return 1

    def bound_generations(self, limit: int) -> None:
        """Each (prompt, sample) pair is a Generate call of its own: past `limit` of them the request
        is refused before any starts, so one small body cannot fill the worker for everyone."""
        prompts = self.prompt_count
        if prompts * self.n > limit:
            raise ApiError(
                400,
                f"This request asks for {prompts} prompt(s) × n={self.n} = {prompts * self.n} "
                f"generations; this server starts at most {limit} per request.",
                "n" if prompts == 1 else "prompt",
                "too_many_generations",
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sdk_sampling(self, logprobs: int) -> dict:
        """The SDK's sampling arguments; no max_tokens means what the context leaves (OpenAI's default)."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        return {
            "max_tokens": max_tokens,
            "max_tokens_to_limit": max_tokens is None,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
        }


class TextPart(Closed):
    type: Literal["text"]
    text: str


class FunctionCall(Closed):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Closed):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Closed):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call
    reasoning_content: str | None = None  # an assistant's reasoning, as this gateway returned it

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        """ValueError: pydantic names the message (messages.2) in the 400."""
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry `tool_calls`")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a message with role tool, and only such a message, has `tool_call_id`")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry `reasoning_content`")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs `content`")
        return self

    def sdk_message(self) -> dict:
        """Developer messages are system messages to a chat template; text parts join into one."""
        content = (
            self.content if isinstance(self.content, str | None) else "".join(p.text for p in self.content)
        )
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDef(Closed):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # kept whole where the tools' schemas do not all fit (constraints.py)


class Tool(Closed):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Closed):
    name: str


class NamedToolChoice(Closed):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extension: more variables for the chat template ({"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's extensions: the final message rendered open, so the reply continues it (an answer
    # begun for the model); the prompt rendered without the turn that opens a reply
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_end_of_the_prompt(self):
        asked = "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt
        if self.continue_final_message and asked:
            raise ApiError(
                400,
                "`continue_final_message` and `add_generation_prompt` cannot both be true: the prompt "
                "either opens a new reply or continues the final message",
                "continue_final_message",
            )
        return self

    @property
    def opens_a_reply(self) -> bool:
        """Whether the prompt ends with the turn that opens a reply (where a thinking model reasons)."""
        return self.add_generation_prompt and not self.continue_final_message

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "`top_logprobs` needs `logprobs` set to true", "top_logprobs")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ApiError(400, "`tools` names a function twice", "tools")
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ApiError(400, "`tool_choice` other than none or auto needs `tools`", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ApiError(
                400,
                f"`tool_choice` names {self.tool_choice.function.name!r}, which `tools` lacks",
                "tool_choice",
            )
        return self

    @property
    def tool_mode(self) -> str | NamedToolChoice:
        """ "none", "auto", "required" or the named function; OpenAI's default: auto with tools."""
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def alternatives(self) -> int | None:
        """Alternatives per token, or None when no logprobs were asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of not in (None, self.n):
            raise ApiError(400, "`best_of` other than `n` is not supported by this server", "best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ApiError(400, "`prompt` must not be an empty list", "prompt")
        return self

    @property
    def alternatives(self) -> int | None:
        return self.logprobs

    @property
    def prompt_count(self) -> int:
        return len(self.prompts())

    def prompts(self) -> list[dict]:
        """Each prompt as the SDK's input argument: {"prompt": text} or {"token_ids": ids}."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if all(isinstance(p, int) for p in prompt):
            return [{"token_ids": prompt}]
        return [{"prompt": p} if isinstance(p, str) else {"token_ids": p} for p in prompt]


class LoadLoraRequest(Closed):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(Closed):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients send it; names identify adapters here


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """The request's JSON body as `model`: 413 past `limit` bytes (before reading it when its
    Content-Length says so), 400 naming what is wrong. pydantic parses the JSON, not json.loads,
    which recurses on nesting until RecursionError, raises a bare ValueError on a 5,000-digit number
    and returns lone surrogates that fail once encoded: pydantic refuses all three as invalid JSON."""
    body = await _read(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise invalid_body(e) from None


async def _read(request: Request, limit: int) -> bytes:
    too_large = ApiError(413, f"The request body is larger than this server takes ({limit} bytes).")
    if int(request.headers.get("content-length") or 0) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)

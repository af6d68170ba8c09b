"""Chat and text completions: a parsed request becomes Samples, answered whole or as SSE."""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event

from loramux import Completion, ModelInfo

from .constraints import constrains_from_the_start, constraint
from .errors import ApiError
from .metrics import GatewayMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import Reasoning
from .renderer import ChatRenderer, Renderer, TextRenderer
from .samples import Samples
from .tool_calls import parser_for
from .upstream import Upstream

DONE = format_sse_event(data_str="[DONE]")
# The reader of a choice's reasoning block, for each reasoning format a chat template may have.
REASONING = {"think": lambda: Reasoning(opened=False), "think_opened": lambda: Reasoning(opened=True)}


async def chat(request: Request, body: ChatCompletionRequest, upstream: Upstream, metrics: GatewayMetrics):
    """Tools are shown to the model by the chat template unless tool_choice is "none"."""
    start = time.perf_counter()
    mode = body.tool_mode
    info = await upstream.model_info()
    tool_format = info.tool_call_format if mode == "auto" else ""
    schemas = {tool.function.name: tool.function.parameters or {} for tool in body.tools or []}
    parser = parser_for(mode, tool_format, schemas)
    given = {"messages": [m.sdk_message() for m in body.messages]}
    if body.chat_template_kwargs is not None:
        given["chat_template_kwargs"] = body.chat_template_kwargs
    given |= dict(
        continue_final_message=body.continue_final_message, add_generation_prompt=body.add_generation_prompt
    )
    if parser is not None:
        given["tools"] = [
            tool.function.model_dump(exclude_none=True, exclude={"strict"}) for tool in body.tools
        ]
    reasoning = reasoning_reader(info, body)
    renderer = ChatRenderer(
        body.model, body.alternatives, body.include_usage, tool_parser=parser, reasoning=reasoning
    )
    return await _serve(
        request, body, [given], renderer, upstream, metrics, start, tool_format, info.tool_call_token_id
    )


def reasoning_reader(info: ModelInfo, body: ChatCompletionRequest) -> Callable[[], Reasoning] | None:
    """The reader of each choice's reasoning block, where the template has one. The worker holds a
    constraint after the block, unless it constrains reasoning too: then a reply the request's own
    constraint holds from its first token has no room to reason, so it is read as one that would
    open its block itself, and the answer the constraint shaped is content. A reply that continues
    the final message, or follows a prompt that opens no reply, goes on as it was: all content."""
    if info.reasoning_format not in REASONING:
        return None
    if not body.opens_a_reply:
        return Reasoning.all_content
    shaped = info.constrains_reasoning and constrains_from_the_start(body)
    return REASONING["think" if shaped else info.reasoning_format]


async def text(request: Request, body: CompletionRequest, upstream: Upstream, metrics: GatewayMetrics):
    renderer = TextRenderer(body.model, body.alternatives, body.include_usage)
    return await _serve(request, body, body.prompts(), renderer, upstream, metrics, time.perf_counter())


async def _serve(
    request,
    body,
    inputs: list[dict],
    renderer: Renderer,
    upstream: Upstream,
    metrics,
    start: float,
    tool_format: str = "",
    call_token: int | None = None,
):
    adapter = await upstream.adapter_for(body.model)
    sampling = body.sdk_sampling(_asked_logprobs(body.alternatives)) | constraint(
        body, tool_format, call_token
    )
    samples = await Samples.start(
        upstream.client, body.model, adapter, inputs, body.n, sampling, body.seed, renderer.id
    )
    metrics.first_token.observe(time.perf_counter() - start)
    request.state.model = body.model
    if body.stream:
        return EventSourceResponse(_events(samples, renderer, body.include_usage))
    completions = await _unless_gone(request, samples)
    return JSONResponse(renderer.whole(completions, samples.usage(completions)))


async def _unless_gone(request: Request, samples: Samples) -> list[Completion]:
    """Every completion; if the client hangs up first, the calls are cancelled (the worker frees
    them) instead of running on for nobody, and the client, gone, gets no answer."""
    work = asyncio.ensure_future(samples.completions())
    gone = asyncio.ensure_future(_disconnect(request))
    await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():
        work.cancel()
        samples.close()
        raise ApiError(499, "The client closed the connection before the completion ended.")
    return work.result()


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone: the body is read, so the next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _asked_logprobs(alternatives: int | None) -> int:
    """The worker's logprobs argument: 0 returns none at all, so a request for the chosen token's
    logprob alone asks for one alternative and shows none."""
    return 0 if alternatives is None else max(alternatives, 1)


async def _events(samples: Samples, renderer: Renderer, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per delta and per choice's end, the usage chunk when asked for, then
    [DONE]. An error after the response has started goes out as an error event (the status is sent).
    A client that hangs up: Starlette cancels the task streaming this body, and the cancellation
    ends samples.events(), whose close cancels the Generate calls."""
    ended: dict[int, Completion] = {}
    try:
        async for index, event in samples.events():
            if isinstance(event, Completion):
                ended[index] = event
            yield _sse(renderer.chunk(index, event))
        if include_usage:
            yield _sse(renderer.usage_chunk(samples.usage([ended[i] for i in sorted(ended)])))
    except ApiError as e:
        yield _sse(e.body())
    yield DONE


def _sse(body: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))

"""AsyncClient: the asyncio SDK for a worker (generation) and an adapter store (admin RPCs)."""

from collections.abc import Iterable, Sequence

import grpc

from . import convert
from .connection import DEFAULT_STORE, DEFAULT_WORKER, Connection, channel_opener
from .errors import rpc_errors
from .stream import AsyncStream
from .types import Adapter, Completion, ModelInfo, WorkerAdapter


class AsyncClient:
    """Client's API for asyncio: every method is a coroutine except generate(), which returns an
    AsyncStream to `async for` over. Talks to one worker and one store; each channel opens on first
    use (inside the running event loop); `tls_ca`, `tls_cert` and `tls_key` as for Client.

    `timeout` (seconds) is the gRPC deadline of every call unless a call passes its own; None means
    no deadline. Every failed call raises a `loramux.LoramuxError` subclass named for its status.
    """

    def __init__(
        self,
        worker: str = DEFAULT_WORKER,
        store: str = DEFAULT_STORE,
        api_token: str | None = None,
        admin_token: str | None = None,
        timeout: float | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        channels = channel_opener(grpc.aio, tls_ca, tls_cert, tls_key)
        self._connection = Connection(worker, store, api_token, admin_token, timeout, channels)

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        messages: Sequence[convert.Message] | None = None,
        tools: Sequence[convert.Tool] | None = None,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        add_generation_prompt: bool = True,
        adapter: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **sampling,
    ) -> AsyncStream:
        """Starts a generation from exactly one of prompt, token_ids or messages, with `adapter`
        (None = the base model); convert.generate_request says what messages, tools,
        chat_template_kwargs, continue_final_message, add_generation_prompt and the sampling
        arguments (SamplingParams' fields and one output constraint) take."""
        chat = convert.ChatOptions(tools, chat_template_kwargs, continue_final_message, add_generation_prompt)
        request = convert.generate_request(prompt, token_ids, messages, chat, adapter, request_id, sampling)
        return AsyncStream(self._connection.invoke("worker", "Generate", request, timeout, adapter))

    async def complete(self, prompt: str | None = None, **kwargs) -> Completion:
        """generate() with the same arguments, run to its end: the whole Completion."""
        stream = self.generate(prompt, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    async def worker_adapters(self, *, timeout: float | None = None) -> list[WorkerAdapter]:
        """The adapters the worker holds now: in a device slot, in host memory, or loading."""
        return await self._unary(convert.worker_adapters_rpc(), timeout)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return await self._unary(convert.model_info_rpc(), timeout)

    async def register_adapter(
        self, adapter_id: str, source_uri: str, request_id: str | None = None, *, timeout: float | None = None
    ) -> Adapter:
        """Registers the PEFT checkpoint at source_uri (file:///dir or s3://bucket/prefix)."""
        return await self._unary(convert.register_adapter_rpc(adapter_id, source_uri, request_id), timeout)

    async def get_adapter(self, adapter_id: str, *, timeout: float | None = None) -> Adapter:
        return await self._unary(convert.get_adapter_rpc(adapter_id), timeout)

    async def list_adapters(self, *, page_size: int = 0, timeout: float | None = None) -> list[Adapter]:
        """Every adapter in id order, fetched `page_size` at a time (0 = the store's default);
        `timeout` applies to each page."""
        adapters, token = [], ""
        while True:
            page, token = await self._unary(convert.list_adapters_rpc(page_size, token), timeout)
            adapters.extend(page)
            if not token:
                return adapters

    async def delete_adapter(
        self, adapter_id: str, force: bool = False, *, timeout: float | None = None
    ) -> Adapter:
        """Deletes an adapter (a pinned one only with force); returns it as it was."""
        return await self._unary(convert.delete_adapter_rpc(adapter_id, force), timeout)

    async def pin_adapter(self, adapter_id: str, *, timeout: float | None = None) -> Adapter:
        return await self._unary(convert.pin_adapter_rpc(adapter_id), timeout)

    async def unpin_adapter(self, adapter_id: str, *, timeout: float | None = None) -> Adapter:
        return await self._unary(convert.unpin_adapter_rpc(adapter_id), timeout)

    async def close(self) -> None:
        for channel in self._connection.take_channels():
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, rpc: convert.Rpc, timeout: float | None):
        with rpc_errors():
            reply = await self._connection.invoke(rpc.service, rpc.method, rpc.request, timeout)
        return rpc.decode(reply)

"""Client: the blocking SDK for a worker (generation) and an adapter store (admin RPCs)."""

from collections.abc import Iterable, Sequence

import grpc

from . import convert
from .connection import DEFAULT_STORE, DEFAULT_WORKER, Connection, channel_opener
from .errors import rpc_errors
from .stream import Stream
from .types import Adapter, Completion, ModelInfo, WorkerAdapter


class Client:
    """Talks to one worker and one store; each channel opens on first use, over TLS when `tls_ca`
    (a PEM file: the CA that signed the servers' certificates) is given, presenting the client
    certificate `tls_cert` with its key `tls_key` where a server asks for one (mTLS).

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
        channels = channel_opener(grpc, tls_ca, tls_cert, tls_key)
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
    ) -> Stream:
        """Starts a generation from exactly one of prompt, token_ids or messages, with `adapter`
        (None = the base model); convert.generate_request says what messages, tools,
        chat_template_kwargs, continue_final_message, add_generation_prompt and the sampling
        arguments (SamplingParams' fields and one output constraint) take."""
        chat = convert.ChatOptions(tools, chat_template_kwargs, continue_final_message, add_generation_prompt)
        request = convert.generate_request(prompt, token_ids, messages, chat, adapter, request_id, sampling)
        return Stream(self._connection.invoke("worker", "Generate", request, timeout, adapter))

    def complete(self, prompt: str | None = None, **kwargs) -> Completion:
        """generate() with the same arguments, run to its end: the whole Completion."""
        stream = self.generate(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def worker_adapters(self, *, timeout: float | None = None) -> list[WorkerAdapter]:
        """The adapters the worker holds now: in a device slot, in host memory, or loading."""
        return self._unary(convert.worker_adapters_rpc(), timeout)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return self._unary(convert.model_info_rpc(), timeout)

    def register_adapter(
        self, adapter_id: str, source_uri: str, request_id: str | None = None, *, timeout: float | None = None
    ) -> Adapter:
        """Registers the PEFT checkpoint at source_uri (file:///dir or s3://bucket/prefix)."""
        return self._unary(convert.register_adapter_rpc(adapter_id, source_uri, request_id), timeout)

    def get_adapter(self, adapter_id: str, *, timeout: float | None = None) -> Adapter:
        return self._unary(convert.get_adapter_rpc(adapter_id), timeout)

    def list_adapters(self, *, page_size: int = 0, timeout: float | None = None) -> list[Adapter]:
        """Every adapter in id order, fetched `page_size` at a time (0 = the store's default);
        `timeout` applies to each page."""
        adapters, token = [], ""
        while True:
            page, token = self._unary(convert.list_adapters_rpc(page_size, token), timeout)
            adapters.extend(page)
            if not token:
                return adapters

    def delete_adapter(
        self, adapter_id: str, force: bool = False, *, timeout: float | None = None
    ) -> Adapter:
        """Deletes an adapter (a pinned one only with force); returns it as it was."""
        return self._unary(convert.delete_adapter_rpc(adapter_id, force), timeout)

    def pin_adapter(self, adapter_id: str, *, timeout: float | None = None) -> Adapter:
        return self._unary(convert.pin_adapter_rpc(adapter_id), timeout)

    def unpin_adapter(self, adapter_id: str, *, timeout: float | None = None) -> Adapter:
        return self._unary(convert.unpin_adapter_rpc(adapter_id), timeout)

    def close(self) -> None:
        for channel in self._connection.take_channels():
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, rpc: convert.Rpc, timeout: float | None):
        with rpc_errors():
            reply = self._connection.invoke(rpc.service, rpc.method, rpc.request, timeout)
        return rpc.decode(reply)

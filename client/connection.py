"""Where a client's calls go: one lazily opened channel per address, bearer tokens and deadlines.

The same class serves both clients; only the function that opens a channel differs
(grpc.insecure_channel or grpc.aio.insecure_channel).
"""

from collections.abc import Callable
from typing import Any

from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as store_grpc

DEFAULT_WORKER = "127.0.0.1:50051"
DEFAULT_STORE = "127.0.0.1:50061"
STUBS = {"worker": inference_grpc.InferenceServiceStub, "store": store_grpc.AdapterStoreStub}


class Connection:
    def __init__(
        self,
        worker: str,
        store: str,
        api_token: str | None,
        admin_token: str | None,
        timeout: float | None,
        open_channel: Callable[[str], Any],
    ):
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive seconds or None, got {timeout}")
        self.addresses = {"worker": worker, "store": store}
        self.tokens = {"worker": api_token, "store": admin_token}
        self.timeout = timeout
        self._open_channel = open_channel
        self._channels: dict[str, Any] = {}  # address -> channel; worker and store may share one
        self._stubs: dict[str, Any] = {}

    def invoke(self, service: str, method: str, request, timeout: float | None):
        """Starts `method` on `service` with the token and deadline that apply; returns what the
        stub returns (a reply, a response iterator, or an awaitable call)."""
        stub_method = getattr(self._stub(service), method)
        return stub_method(request, timeout=self._deadline(timeout), metadata=self._metadata(service))

    def take_channels(self) -> list:
        """The open channels, forgotten here so the caller can close them; later calls reopen."""
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        return channels

    def _stub(self, service: str):
        if service not in self._stubs:
            address = self.addresses[service]
            if address not in self._channels:
                self._channels[address] = self._open_channel(address)
            self._stubs[service] = STUBS[service](self._channels[address])
        return self._stubs[service]

    def _metadata(self, service: str) -> tuple[tuple[str, str], ...] | None:
        token = self.tokens[service]
        return (("authorization", f"Bearer {token}"),) if token else None

    def _deadline(self, timeout: float | None) -> float | None:
        """A per-call timeout wins over the client's."""
        return self.timeout if timeout is None else timeout

"""Where a client's calls go: one lazily opened channel per address (plaintext or TLS), bearer
tokens and deadlines.

The same class serves both clients; only the function that opens a channel differs
(from grpc or grpc.aio, see channel_opener).
"""

from collections.abc import Callable
from types import ModuleType
from typing import Any

from shared.errors import InvalidArgument
from shared.names import ADAPTER_ID
from shared.pb.loramux.inference.v1 import inference_pb2_grpc as inference_grpc
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as store_grpc
from shared.tls import ChannelTls

DEFAULT_WORKER = "127.0.0.1:50051"
DEFAULT_STORE = "127.0.0.1:50061"
STUBS = {"worker": inference_grpc.InferenceServiceStub, "store": store_grpc.AdapterStoreStub}
TLS_NAMES = ("tls_ca", "tls_cert", "tls_key")  # how errors name the files: the clients' parameters
# The metadata a router hashes to send an adapter's calls to one worker (deploy/nginx/loramux.conf).
ADAPTER_KEY = "x-loramux-adapter"


def channel_opener(
    channels: ModuleType, tls_ca: str | None, tls_cert: str | None, tls_key: str | None
) -> Callable[[str], Any]:
    """`channels` (grpc or grpc.aio) opening plaintext channels, or with tls_ca TLS ones that trust
    that CA and, given tls_cert and tls_key, present that client certificate (mTLS). The files are
    read here: ValueError naming the file when one is missing, unreadable or not PEM."""
    try:
        tls = ChannelTls.from_files(tls_ca, tls_cert, tls_key, TLS_NAMES)
    except InvalidArgument as e:
        raise ValueError(str(e)) from None
    if tls is None:
        return channels.insecure_channel
    credentials = tls.credentials()
    return lambda address: channels.secure_channel(address, credentials)


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

    def invoke(self, service: str, method: str, request, timeout: float | None, adapter: str | None = None):
        """Starts `method` on `service` with the token and deadline that apply, and `adapter` as
        ADAPTER_KEY metadata; returns what the stub returns (a reply, a response iterator, or an
        awaitable call)."""
        stub_method = getattr(self._stub(service), method)
        metadata = self._metadata(service, adapter)
        return stub_method(request, timeout=self._deadline(timeout), metadata=metadata)

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

    def _metadata(self, service: str, adapter: str | None) -> tuple[tuple[str, str], ...] | None:
        """The bearer token, and the adapter name unless it breaks the naming rule (the worker
        then refuses it by name; as metadata gRPC would fail the call with a vaguer INTERNAL)."""
        token = self.tokens[service]
        pairs = [("authorization", f"Bearer {token}")] if token else []
        if adapter and ADAPTER_ID.fullmatch(adapter):
            pairs.append((ADAPTER_KEY, adapter))
        return tuple(pairs) or None

    def _deadline(self, timeout: float | None) -> float | None:
        """A per-call timeout wins over the client's."""
        return self.timeout if timeout is None else timeout

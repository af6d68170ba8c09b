"""The worker's channel to its adapter store: plaintext or TLS (with a client certificate for
mTLS), and the worker token on every call, so fetch and watch code never handles credentials."""

import grpc

from shared.grpc_server import KEEPALIVE
from shared.tls import ChannelTls

MAX_MESSAGE_BYTES = 16 << 20  # what the worker takes in from the store (fetch chunks are 1 MiB)
OPTIONS = [*KEEPALIVE, ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def open_store_channel(address: str, tls: ChannelTls | None, token: str | None) -> grpc.Channel:
    """A channel to the store at `address`; with `token`, each call carries it as a bearer token
    (FetchAdapter and WatchAdapters need it when the store runs with --worker-token)."""
    if tls is None:
        channel = grpc.insecure_channel(address, options=OPTIONS)
    else:
        channel = grpc.secure_channel(address, tls.credentials(), options=OPTIONS)
    if token is None:
        return channel
    return grpc.intercept_channel(channel, BearerToken(token))


class BearerToken(grpc.UnaryStreamClientInterceptor):
    """Adds "authorization: Bearer <token>" to the metadata of every server-streaming call: all
    the worker makes to its store (FetchAdapter, WatchAdapters)."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def intercept_unary_stream(self, continuation, details, request):
        # grpc hands interceptors its call details as a namedtuple
        return continuation(details._replace(metadata=[*(details.metadata or ()), self._header]), request)

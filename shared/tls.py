"""TLS material for gRPC servers and channels, as PEM bytes read once when a process's config is
built: a missing, unreadable or wrong file stops the process at startup, naming its flag and
path, instead of failing every handshake later with a status that names neither."""

import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from shared.errors import InvalidArgument

CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----")
PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----")


def read_pem(path: Path | str, flag: str, block: re.Pattern) -> bytes:
    """The bytes of the PEM file `path` (given by `flag`), which must hold a `block`."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if not block.search(data):
        kind = "a certificate" if block is CERTIFICATE else "a private key"
        raise InvalidArgument(f"{flag} {path}: not a PEM file holding {kind}")
    return data


@dataclass(frozen=True)
class ServerTls:
    """What a server presents (its certificate chain and key) and, for mTLS, the CA whose
    certificates clients must present; without `client_ca` any client may connect."""

    cert_chain: bytes = field(repr=False)
    key: bytes = field(repr=False)
    client_ca: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_flags(cls, cert: Path | None, key: Path | None, client_ca: Path | None) -> "ServerTls | None":
        """--tls-cert, --tls-key and --tls-client-ca read; None (plaintext) when none is given."""
        if cert is None and key is None:
            if client_ca is not None:
                raise InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key: mTLS runs over TLS")
            return None
        if cert is None or key is None:
            raise InvalidArgument("--tls-cert and --tls-key go together; only one of them was given")
        return cls(
            read_pem(cert, "--tls-cert", CERTIFICATE),
            read_pem(key, "--tls-key", PRIVATE_KEY),
            None if client_ca is None else read_pem(client_ca, "--tls-client-ca", CERTIFICATE),
        )

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class ChannelTls:
    """What a client trusts (the CA that signed the server's certificate) and, for mTLS, the
    certificate chain and key it presents."""

    ca: bytes = field(repr=False)
    cert_chain: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_files(
        cls,
        ca: Path | str | None,
        cert: Path | str | None,
        key: Path | str | None,
        names: tuple[str, str, str],
    ) -> "ChannelTls | None":
        """The three files read, each named in errors by its entry of `names` (a flag or a
        parameter); None (plaintext) when none is given."""
        ca_name, cert_name, key_name = names
        if (cert is None) != (key is None):
            raise InvalidArgument(f"{cert_name} and {key_name} go together; only one of them was given")
        if ca is None:
            if cert is not None:
                raise InvalidArgument(f"{cert_name} needs {ca_name}: a client certificate is sent over TLS")
            return None
        if cert is None:
            return cls(read_pem(ca, ca_name, CERTIFICATE))
        return cls(
            read_pem(ca, ca_name, CERTIFICATE),
            read_pem(cert, cert_name, CERTIFICATE),
            read_pem(key, key_name, PRIVATE_KEY),
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert_chain)

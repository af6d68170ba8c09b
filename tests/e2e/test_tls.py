"""TLS, mTLS and the worker token, between real processes on loopback with certificates made here:
a store that wants client certificates and a worker token, a worker that serves TLS and fetches
from the store with a good client certificate, and a worker whose certificate the store refuses."""

import asyncio
import datetime
import ipaddress
import re
import ssl
import time
from pathlib import Path

import grpc
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

import loramux
from adapter_store.__main__ import parse_config as parse_store_flags
from bench.random_adapter import write_random_adapter
from inference_service.server.main import parse_config as parse_worker_flags
from loramux import cli
from shared.errors import InvalidArgument
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2 as store_pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as store_grpc
from tests.adapter_store.conftest import ADMIN_TOKEN, StoreProcess, spawn

WORKER_TOKEN = "fetch-and-watch"
ADAPTER = "qv4"
PROMPT = [5, 6, 7, 8]
SERVER_SANS = (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"))


class Pki:
    """A CA ("ca") signing a server certificate for 127.0.0.1/localhost and a client one; another
    CA ("other_ca") signing a "stranger" client certificate. Attributes are PEM file paths."""

    def __init__(self, folder: Path):
        self._folder = folder
        ca_key, other_key = _key(), _key()
        self.ca = self._cert("ca", _certificate("ca", ca_key, "ca", ca_key))
        self.other_ca = self._cert("other_ca", _certificate("other_ca", other_key, "other_ca", other_key))
        self.server_cert, self.server_key = self._issue(
            "server", "ca", ca_key, ExtendedKeyUsageOID.SERVER_AUTH
        )
        self.client_cert, self.client_key = self._issue(
            "client", "ca", ca_key, ExtendedKeyUsageOID.CLIENT_AUTH
        )
        self.stranger_cert, self.stranger_key = self._issue(
            "stranger", "other_ca", other_key, ExtendedKeyUsageOID.CLIENT_AUTH
        )

    def _issue(self, name: str, issuer: str, issuer_key, usage) -> tuple[Path, Path]:
        key = _key()
        sans = SERVER_SANS if usage == ExtendedKeyUsageOID.SERVER_AUTH else ()
        path = self._folder / f"{name}.key"
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return self._cert(name, _certificate(name, key, issuer, issuer_key, usage, sans)), path

    def _cert(self, name: str, certificate: x509.Certificate) -> Path:
        path = self._folder / f"{name}.crt"
        path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        return path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # P-256: a key in a millisecond, RSA 2048 takes ~100


def _certificate(subject: str, key, issuer: str, issuer_key, usage=None, sans=()) -> x509.Certificate:
    """Self-signed CA certificate without `usage`; otherwise a leaf for that extended key usage."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=usage is None, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_models) -> Path:
    """The store's allowed root, holding ADAPTER (rank 4 on q and v) for the tiny llama."""
    root = tmp_path_factory.mktemp("tls-sources")
    model = ModelConfig.from_dir(tiny_models["llama"])
    write_random_adapter(model, root / ADAPTER, rank=4, seed=1, targets=("q_proj", "v_proj"))
    return root


@pytest.fixture(scope="module")
def mtls_store(tmp_path_factory, tiny_models, sources, pki):
    """A store serving TLS that wants client certificates from `ca`, the admin token on admin RPCs
    and WORKER_TOKEN on fetch and watch."""
    flags = [
        *("--allowed-root", str(sources), "--base-model", str(tiny_models["llama"]), "--max-lora-rank", "16"),
        *("--admin-token", ADMIN_TOKEN, "--worker-token", WORKER_TOKEN, "--tls-client-ca", str(pki.ca)),
        *("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)),
    ]
    store = StoreProcess(tmp_path_factory.mktemp("tls-store"), flags).start()
    yield store
    assert store.stop() == 0


@pytest.fixture(scope="module")
def digest(mtls_store, sources, pki) -> str:
    """ADAPTER registered through the SDK over mTLS; its digest."""
    with _store_client(mtls_store, pki, str(pki.client_cert), str(pki.client_key)) as admin:
        return admin.register_adapter(ADAPTER, f"file://{sources / ADAPTER}").digest


def _store_client(store, pki: Pki, cert: str | None, key: str | None) -> loramux.Client:
    return loramux.Client(
        store=store.address,
        admin_token=ADMIN_TOKEN,
        timeout=10,
        tls_ca=str(pki.ca),
        tls_cert=cert,
        tls_key=key,
    )


class Worker:
    """`python -m inference_service` on the tiny llama, fetching from `store` with `flags`; waited
    for until ready (over TLS when `credentials` are given, as its clients will reach it)."""

    def __init__(self, folder: Path, model: Path, store, flags: list[str], credentials=None):
        args = ["--listen", "127.0.0.1:0", "--model", str(model), "--store", store.address, *flags]
        self.log = folder / "worker.log"
        self.process, self.address = spawn(
            "inference_service", args, {"LORAMUX_CACHE": str(folder)}, self.log
        )
        self._wait_ready(credentials)

    def _wait_ready(self, credentials: grpc.ChannelCredentials | None, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        if credentials is None:
            channel = grpc.insecure_channel(self.address)
        else:
            channel = grpc.secure_channel(self.address, credentials)
        with channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="readiness")
            while time.monotonic() < deadline:
                if health.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING:
                    return
                time.sleep(0.1)
        raise RuntimeError(f"worker not ready:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def tls_worker(tmp_path_factory, tiny_models, mtls_store, pki):
    """Serves TLS with the server certificate; fetches with the good client certificate and token."""
    flags = [
        *("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)),
        *("--store-tls-ca", str(pki.ca), "--store-token", WORKER_TOKEN),
        *("--store-tls-cert", str(pki.client_cert), "--store-tls-key", str(pki.client_key)),
    ]
    credentials = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    worker = Worker(
        tmp_path_factory.mktemp("tls-worker"), tiny_models["llama"], mtls_store, flags, credentials
    )
    yield worker
    assert worker.stop() == 0


@pytest.fixture(scope="module")
def stranger_worker(tmp_path_factory, tiny_models, mtls_store, pki):
    """Plaintext to its clients; presents a client certificate from the wrong CA to the store."""
    flags = [
        *("--store-tls-ca", str(pki.ca), "--store-token", WORKER_TOKEN, "--fetch-idle-timeout", "5"),
        *("--store-tls-cert", str(pki.stranger_cert), "--store-tls-key", str(pki.stranger_key)),
    ]
    worker = Worker(tmp_path_factory.mktemp("stranger-worker"), tiny_models["llama"], mtls_store, flags)
    yield worker
    assert worker.stop() == 0


def _complete(client, adapter: str | None = None) -> loramux.Completion:
    return client.complete(token_ids=PROMPT, adapter=adapter, max_tokens=4, temperature=0)


def test_sdk_with_the_right_ca_generates_with_an_adapter_fetched_over_mtls(tls_worker, digest, pki):
    with loramux.Client(worker=tls_worker.address, timeout=60, tls_ca=str(pki.ca)) as client:
        base, tuned = _complete(client), _complete(client, ADAPTER)
        held = {a.adapter_id: a.digest for a in client.worker_adapters()}
    assert base.completion_tokens == tuned.completion_tokens == 4
    assert held[ADAPTER] == digest  # fetched from the mTLS store with the worker token

    async def complete_async() -> loramux.Completion:
        async with loramux.AsyncClient(worker=tls_worker.address, timeout=60, tls_ca=str(pki.ca)) as client:
            return await client.complete(token_ids=PROMPT, adapter=ADAPTER, max_tokens=4, temperature=0)

    assert asyncio.run(complete_async()).token_ids == tuned.token_ids


def test_sdk_without_tls_or_trusting_another_ca_is_refused(tls_worker, pki):
    for tls_ca in (None, str(pki.other_ca)):
        client = loramux.Client(worker=tls_worker.address, timeout=10, tls_ca=tls_ca)
        with client, pytest.raises(loramux.Unavailable):
            client.model_info()


def test_store_refuses_clients_without_a_certificate_from_its_ca(mtls_store, digest, pki):
    for cert, key in ((None, None), (str(pki.stranger_cert), str(pki.stranger_key))):
        with _store_client(mtls_store, pki, cert, key) as client, pytest.raises(loramux.Unavailable):
            client.list_adapters()
    with _store_client(mtls_store, pki, str(pki.client_cert), str(pki.client_key)) as client:
        assert [a.adapter_id for a in client.list_adapters()] == [ADAPTER]


def test_worker_with_a_wrong_client_certificate_cannot_fetch_and_still_serves_the_base_model(
    stranger_worker, digest
):
    with loramux.Client(worker=stranger_worker.address, timeout=30) as client:
        with pytest.raises(loramux.Unavailable) as refused:
            _complete(client, ADAPTER)
        assert repr(ADAPTER) in refused.value.message and "adapter store" in refused.value.message
        assert _complete(client).completion_tokens == 4


def test_fetch_and_watch_need_the_worker_token_and_health_stays_open(mtls_store, digest, pki):
    credentials = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
    )
    with grpc.secure_channel(mtls_store.address, credentials) as channel:
        store = store_grpc.AdapterStoreStub(channel)
        fetch = store_pb.FetchAdapterRequest(adapter_id=ADAPTER)
        for method, request in (("FetchAdapter", fetch), ("WatchAdapters", store_pb.WatchAdaptersRequest())):
            assert _first_error(getattr(store, method)(request, timeout=10)) == (
                grpc.StatusCode.UNAUTHENTICATED,
                f"/loramux.store.v1.AdapterStore/{method} needs a bearer token",
            )
        admin = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
        code, details = _first_error(store.FetchAdapter(fetch, timeout=10, metadata=admin))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "bearer token is wrong" in details
        worker = (("authorization", f"Bearer {WORKER_TOKEN}"),)
        header = next(store.FetchAdapter(fetch, timeout=10, metadata=worker)).header
        assert header.digest == digest
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def _first_error(stream) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        next(stream)
    return e.value.code(), e.value.details()


def test_cli_connects_with_the_right_ca_and_names_a_missing_file(tls_worker, pki, tmp_path, capsys):
    assert cli.run(["--worker", tls_worker.address, "--timeout", "30", "model-info"], {}) == 1
    assert "loramux: UNAVAILABLE: " in capsys.readouterr().err
    env = {"LORAMUX_TLS_CA": str(pki.ca)}
    assert cli.run(["--worker", tls_worker.address, "--timeout", "30", "model-info"], env) == 0
    assert "max_loras: 4" in capsys.readouterr().out
    missing = tmp_path / "missing.pem"
    with pytest.raises(SystemExit) as usage:
        cli.run(["--tls-ca", str(missing), "model-info"], {})
    assert usage.value.code == 2
    assert f"tls_ca {missing}: cannot read it" in capsys.readouterr().err


def test_sdk_names_the_tls_file_it_cannot_use(pki, tmp_path):
    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=re.escape(f"tls_ca {missing}: cannot read it")):
        loramux.Client(tls_ca=str(missing))
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        loramux.AsyncClient(tls_ca=str(pki.ca), tls_cert=str(pki.client_cert))
    with pytest.raises(
        ValueError, match=re.escape(f"tls_key {pki.client_cert}: not a PEM file holding a private key")
    ):
        loramux.Client(tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_cert))


def test_servers_name_the_flag_and_file_they_cannot_use_at_startup(pki, tmp_path):
    missing = tmp_path / "missing.pem"
    store = ["--data-dir", str(tmp_path)]
    with pytest.raises(InvalidArgument, match=re.escape(f"--tls-cert {missing}: cannot read it")):
        parse_store_flags([*store, "--tls-cert", str(missing), "--tls-key", str(pki.server_key)])
    with pytest.raises(
        InvalidArgument, match=re.escape(f"--tls-client-ca {pki.server_key}: not a PEM file holding a cert")
    ):
        tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
        parse_store_flags([*store, *tls, "--tls-client-ca", str(pki.server_key)])
    with pytest.raises(InvalidArgument, match="--tls-client-ca needs --tls-cert and --tls-key"):
        parse_store_flags([*store, "--tls-client-ca", str(pki.ca)])
    worker = ["--model", "m", "--store", "127.0.0.1:1"]
    with pytest.raises(InvalidArgument, match=re.escape(f"--store-tls-ca {missing}: cannot read it")):
        parse_worker_flags([*worker, "--store-tls-ca", str(missing)])
    with pytest.raises(InvalidArgument, match="--store-tls-cert needs --store-tls-ca"):
        parse_worker_flags(
            [*worker, "--store-tls-cert", str(pki.client_cert), "--store-tls-key", str(pki.client_key)]
        )
    with pytest.raises(InvalidArgument, match="--tls-cert and --tls-key go together"):
        parse_worker_flags([*worker, "--tls-cert", str(pki.server_cert)])


def test_the_gateway_serves_https_and_reaches_tls_services_with_its_own_certificate(
    tls_worker, mtls_store, digest, pki, tmp_path
):
    """HTTPS with client certificates (uvicorn's flags) in front; TLS to the worker and mTLS to the
    store behind, with the gateway's client certificate and the store's admin token."""
    upstream = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    https = ["--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key)]
    args = ["--listen", "127.0.0.1:0", "--worker", tls_worker.address, "--store", mtls_store.address]
    args += [*upstream, *https, "--ssl-ca-certs", str(pki.ca), "--admin-token", ADMIN_TOKEN]
    process, address = spawn("openai_gateway", args, {}, tmp_path / "gateway.log")
    try:
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(pki.client_cert, pki.client_key)
        trusted = openai.DefaultHttpxClient(verify=context)
        client = openai.OpenAI(
            base_url=f"https://{address}/v1", api_key="x", max_retries=0, http_client=trusted
        )
        with client:
            assert ADAPTER in [m.id for m in client.models.list().data]  # read from the store over mTLS
            reply = client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=3, temperature=0)
            assert reply.usage.completion_tokens == 3  # generated by the worker over TLS
        stranger = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(pki.ca)))  # no cert
        with (
            openai.OpenAI(
                base_url=f"https://{address}/v1", api_key="x", max_retries=0, http_client=stranger
            ) as c,
            pytest.raises(openai.APIConnectionError),
        ):
            c.models.list()
    finally:
        process.terminate()
        assert process.wait(timeout=15) == 0

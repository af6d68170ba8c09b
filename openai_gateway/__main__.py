"""python -m openai_gateway: the OpenAI-compatible HTTP gateway in front of a worker and a store."""

import argparse
import os
import signal
import socket
import ssl
import sys
from pathlib import Path

import uvicorn

from .app import create_app
from .config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_GENERATIONS, GatewayConfig, HttpsFiles, UpstreamTls


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m openai_gateway", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (port 0 picks a free one)")
    p.add_argument("--worker", default="127.0.0.1:50051", help="worker (or router) HOST:PORT")
    p.add_argument("--store", default="127.0.0.1:50061", help="adapter store HOST:PORT")
    p.add_argument(
        "--served-model-name", help="the base model's name in the API (default: the worker's model)"
    )
    p.add_argument(
        "--api-key", default=os.environ.get("LORAMUX_GATEWAY_API_KEY"), help="Bearer key /v1 needs"
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("LORAMUX_ADMIN_TOKEN"),
        help="the store's admin token: sent to it, and what load/unload callers must present",
    )
    p.add_argument(
        "--worker-token", default=os.environ.get("LORAMUX_API_TOKEN"), help="the worker's api token"
    )
    p.add_argument("--tls-ca", type=Path, help="PEM CA of the worker's and store's certificates: TLS to them")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate for the worker and store (mTLS)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument(
        "--ssl-certfile", type=Path, help="PEM certificate chain: serve HTTPS (needs --ssl-keyfile)"
    )
    p.add_argument("--ssl-keyfile", type=Path, help="PEM private key of --ssl-certfile")
    p.add_argument(
        "--ssl-ca-certs", type=Path, help="PEM CA: HTTPS clients must present a certificate it signed"
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    p.add_argument(
        "--max-generations-per-request",
        type=int,
        default=DEFAULT_MAX_GENERATIONS,
        help="Generate calls (prompts × n) one request may start; more get 400",
    )
    p.add_argument("--timeout", type=float, help="deadline in seconds of each gRPC call (default none)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds streams get after SIGTERM")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> GatewayConfig:
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together; only one of them was given")
    if args.ssl_ca_certs is not None and args.ssl_certfile is None:
        raise ValueError(
            "--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile: client certificates need HTTPS"
        )
    https = (
        None
        if args.ssl_certfile is None
        else HttpsFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    )
    return GatewayConfig(
        worker=args.worker,
        store=args.store,
        listen=args.listen,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        admin_token=args.admin_token,
        worker_token=args.worker_token,
        upstream_tls=UpstreamTls(args.tls_ca, args.tls_cert, args.tls_key),
        https=https,
        max_body_bytes=args.max_body_bytes,
        max_generations_per_request=args.max_generations_per_request,
        timeout_s=args.timeout,
        drain_timeout_s=args.drain_timeout,
    )


def bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), int(port)))
    sock.listen(2048)
    return sock


def server(config: GatewayConfig) -> uvicorn.Server:
    https = config.https
    tls = {}
    if https is not None:
        tls = {"ssl_certfile": str(https.certfile), "ssl_keyfile": str(https.keyfile)}
        if https.client_ca is not None:
            tls |= {"ssl_ca_certs": str(https.client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    app = create_app(config)
    settings = uvicorn.Config(
        app,
        loop="uvloop",
        log_level="warning",
        access_log=False,
        # Idle connections stay open past uvicorn's 5 s, so bursty clients and a load balancer's
        # pooled connections are not torn down and reopened between requests.
        timeout_keep_alive=75,
        timeout_graceful_shutdown=config.drain_timeout_s,
        **tls,
    )
    return uvicorn.Server(settings)


def main(argv: list[str] | None = None) -> None:
    try:
        config = config_from(parse_args(argv))
        sock = bind(config.listen)
        gateway = server(config)
    except (ValueError, OSError) as e:
        sys.exit(f"openai gateway: {e}")
    host, port = sock.getsockname()[:2]
    scheme = "https" if config.https else "http"
    print(f"openai gateway ({scheme}) listening on {host}:{port}", flush=True)
    # uvicorn raises the signal that stopped it again once it has drained; by then the stop is
    # clean, so it ends the process with 0 (as the worker's and store's stops do), not by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(0))
    gateway.run(sockets=[sock])  # on the event loop the config names (uvloop), as asyncio.run would not


if __name__ == "__main__":
    main()

"""python -m adapter_store --listen HOST:PORT --data-dir DIR [--allowed-root DIR ...]
[--s3-endpoint URL] [--s3-allowed-bucket NAME ...] [--admin-token TOKEN] [--base-model DIR]
[--worker-token TOKEN] [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]
[--catalog s3://bucket/prefix [--catalog-poll-s S]]"""

import argparse
import logging
import os
import sys
from pathlib import Path

import uvloop

from adapter_store.config import StoreConfig
from adapter_store.server import serve
from shared.dtypes import DTYPES
from shared.errors import LoramuxError
from shared.tls import ServerTls


def build_parser() -> argparse.ArgumentParser:
    """The store's flags; deploy/k8s tests parse the manifests' command lines with it."""
    p = argparse.ArgumentParser(prog="python -m adapter_store", description="The loramux adapter store.")
    p.add_argument("--listen", default="127.0.0.1:50061", help="HOST:PORT (port 0 picks a free one)")
    p.add_argument("--data-dir", type=Path, required=True, help="where blobs and the catalog live")
    p.add_argument(
        "--allowed-root", type=Path, action="append", default=[], help="file:// sources must be under one"
    )
    p.add_argument(
        "--s3-endpoint",
        default=os.environ.get("LORAMUX_S3_ENDPOINT"),
        help="S3 API endpoint URL (default: $LORAMUX_S3_ENDPOINT, else boto3's own)",
    )
    p.add_argument("--s3-allowed-bucket", action="append", default=[], help="s3:// sources must name one")
    p.add_argument(
        "--admin-token",
        default=os.environ.get("LORAMUX_ADMIN_TOKEN"),
        help="bearer token admin RPCs need (default: $LORAMUX_ADMIN_TOKEN; none = open)",
    )
    p.add_argument(
        "--worker-token",
        default=os.environ.get("LORAMUX_WORKER_TOKEN"),
        help="bearer token FetchAdapter and WatchAdapters need (default: $LORAMUX_WORKER_TOKEN; none = open)",
    )
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain to serve TLS with (needs --tls-key)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", type=Path, help="PEM CA: clients must present a certificate it signed")
    p.add_argument("--base-model", type=Path, help="HF model folder adapters are validated against")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="serving dtype of stored blobs")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument(
        "--max-adapter-bytes",
        type=int,
        default=0,
        help="largest source file accepted (0: as large as an adapter of --max-lora-rank on every module "
        "of --base-model can be in float32, at least 1 GiB; 1 GiB without --base-model)",
    )
    p.add_argument(
        "--catalog",
        help="s3://bucket/prefix: a catalog and blobs shared with other stores, through --s3-endpoint "
        "(default: SQLite and blobs in --data-dir)",
    )
    p.add_argument(
        "--catalog-poll-s", type=float, default=2.0, help="how often other stores' changes are looked for"
    )
    p.add_argument("--metrics-listen", help="HOST:PORT of Prometheus /metrics (port 0: any; default off)")
    return p


def parse_config(argv: list[str]) -> StoreConfig:
    args = build_parser().parse_args(argv)
    return StoreConfig(
        data_dir=args.data_dir,
        listen=args.listen,
        allowed_roots=tuple(args.allowed_root),
        s3_endpoint=args.s3_endpoint,
        s3_allowed_buckets=tuple(args.s3_allowed_bucket),
        admin_token=args.admin_token,
        worker_token=args.worker_token,
        tls=ServerTls.from_flags(args.tls_cert, args.tls_key, args.tls_client_ca),
        base_model=args.base_model,
        dtype=args.dtype,
        max_lora_rank=args.max_lora_rank,
        max_adapter_bytes=args.max_adapter_bytes,
        catalog=args.catalog,
        catalog_poll_s=args.catalog_poll_s,
        metrics_listen=args.metrics_listen,
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(sys.argv[1:])
    except LoramuxError as e:
        sys.exit(f"adapter store: {e}")
    try:
        uvloop.run(serve(config))
    except LoramuxError as e:  # at start: a shared catalog S3 cannot serve, an address not to be had
        sys.exit(f"adapter store: {e}")


if __name__ == "__main__":
    main()

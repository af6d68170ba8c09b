"""The worker's command line, run by `python -m inference_service`: flags and environment to a
WorkerConfig, then serve.

python -m inference_service --listen HOST:PORT --store HOST:PORT --model DIR [--device cpu|cuda]
[--dtype float32|bfloat16|float16] [--quantization none|int8|nf4] [--max-loras N] [--max-lora-rank R]
[--adapter-memory BYTES] [--max-cpu-loras M]"""

import argparse
import logging
import os
import sys
from pathlib import Path

import uvloop

from inference_service.adapters.blob_fetch import FetchLimits
from inference_service.default_model import prepare_default_model
from inference_service.engine.config import EngineConfig
from inference_service.model.base_weight import QUANTIZATIONS
from inference_service.server.server import serve
from inference_service.server.worker_config import DEFAULT_MAX_MESSAGE_BYTES, WorkerConfig
from shared import tcmalloc
from shared.dtypes import DTYPES
from shared.errors import LoramuxError
from shared.tls import ChannelTls, ServerTls

STORE_TLS_FLAGS = ("--store-tls-ca", "--store-tls-cert", "--store-tls-key")


def build_parser() -> argparse.ArgumentParser:
    """The worker's flags; deploy/k8s tests parse the manifests' command lines with it."""
    p = argparse.ArgumentParser(prog="python -m inference_service", description="A loramux inference worker.")
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0 picks a free one)")
    p.add_argument("--store", help="adapter store HOST:PORT (none: base model only)")
    p.add_argument("--model", help="HF model folder (default: SmolLM2-135M-Instruct under $LORAMUX_CACHE)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="the linear layers' base weights, quantized as they load: int8 (weight-only) or nf4 (QLoRA's)",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="the default --adapter-memory holds this many adapters of --max-lora-rank on every module",
    )
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument(
        "--adapter-memory",
        type=int,
        default=0,
        metavar="BYTES",
        help="device memory for adapters, shared by all in pages of 8 rank rows (a rank-8 adapter on "
        "q and v takes a small part of a rank-64 one on every module); 0: as --max-loras says",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=8,
        help="adapters kept ready in host memory (0: each only until its waiting requests are admitted)",
    )
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens in one step: decodes and prefill chunks",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="prompt + output tokens of one request (or the model's)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=0,
        help="KV cache positions; 0: as much as --kv-cache-memory (CPU) or --gpu-memory-utilization allows",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=1 << 30,
        metavar="BYTES",
        help="on a CPU, the KV cache's bytes (default 1 GiB; no more than --max-num-seqs full requests use)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on CUDA, the share of the GPU for weights, adapter memory, activations and the KV cache",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full instead of reusing KV blocks of earlier requests' prefixes",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="seconds one engine step may run before the worker exits",
    )
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a request waits at most for its output constraint (JSON schema, regex, grammar) "
        "to compile before it is refused",
    )
    p.add_argument(
        "--constrain-reasoning",
        action="store_true",
        help="hold a thinking model's reasoning block to a chat request's output constraint too; by "
        "default the block's text is free and the constraint holds what follows it",
    )
    p.add_argument(
        "--eager", action="store_true", help="on a GPU, run decode steps eagerly instead of from CUDA graphs"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many ranks (processes this worker starts; on CUDA one GPU each)",
    )
    p.add_argument(
        "--fully-sharded-loras",
        action="store_true",
        help="split every adapter over the ranks (S-LoRA): about 1/N of it per rank, for an exchange a layer",
    )
    p.add_argument("--max-pending", type=int, default=256, help="Generate calls held at once")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds streams get after SIGTERM")
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest request message taken in (default 4 MiB); longer ones are refused unread",
    )
    p.add_argument(
        "--max-adapter-bytes",
        type=int,
        default=0,
        help="largest adapter blob fetched (0: as large as an adapter of --max-lora-rank on every module "
        "of the model can be in float32, at least 1 GiB)",
    )
    p.add_argument("--fetch-idle-timeout", type=float, default=10.0, help="seconds a fetch may go silent")
    p.add_argument("--fetch-timeout", type=float, default=120.0, help="seconds one adapter fetch may take")
    p.add_argument("--api-token", default=os.environ.get("LORAMUX_API_TOKEN"), help="token Generate needs")
    p.add_argument("--metrics-listen", help="HOST:PORT of Prometheus /metrics (port 0: any; default off)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain to serve TLS with (needs --tls-key)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", type=Path, help="PEM CA: clients must present a certificate it signed")
    p.add_argument("--store-tls-ca", type=Path, help="PEM CA that signed the store's certificate: TLS to it")
    p.add_argument("--store-tls-cert", type=Path, help="PEM client certificate for the store (mTLS)")
    p.add_argument("--store-tls-key", type=Path, help="PEM private key of --store-tls-cert")
    p.add_argument(
        "--store-token",
        default=os.environ.get("LORAMUX_WORKER_TOKEN"),
        help="bearer token for the store's FetchAdapter and WatchAdapters (default: $LORAMUX_WORKER_TOKEN)",
    )
    return p


def parse_config(argv: list[str]) -> WorkerConfig:
    args = build_parser().parse_args(argv)
    cache = Path(os.environ.get("LORAMUX_CACHE", ".cache"))
    model = args.model or str(prepare_default_model(cache))
    engine = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        adapter_memory=args.adapter_memory,
        max_cpu_loras=args.max_cpu_loras,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_caching=not args.no_prefix_caching,
        step_timeout_s=args.step_timeout,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        constrain_reasoning=args.constrain_reasoning,
        cuda_graphs=not args.eager,
        tensor_parallel_size=args.tensor_parallel_size,
        fully_sharded_loras=args.fully_sharded_loras,
    )
    return WorkerConfig(
        engine=engine,
        cache_dir=cache / "adapters",
        listen=args.listen,
        store=args.store,
        api_token=args.api_token,
        tls=ServerTls.from_flags(args.tls_cert, args.tls_key, args.tls_client_ca),
        store_tls=ChannelTls.from_files(
            args.store_tls_ca, args.store_tls_cert, args.store_tls_key, STORE_TLS_FLAGS
        ),
        store_token=args.store_token,
        max_pending=args.max_pending,
        drain_timeout_s=args.drain_timeout,
        max_message_bytes=args.max_message_bytes,
        metrics_listen=args.metrics_listen,
        fetch=FetchLimits(args.max_adapter_bytes, args.fetch_idle_timeout, args.fetch_timeout),
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(sys.argv[1:])
        if config.engine.device == "cpu" and not tcmalloc.loaded():
            logging.getLogger(__name__).info("CPU worker on glibc's malloc: %s", tcmalloc.ADVICE)
        uvloop.run(serve(config))
    except LoramuxError as e:  # flags, or a model and cache sizes that cannot serve
        sys.exit(f"inference worker: {e}")

"""A tensor-parallel rank other than 0 (rank_group.py starts it): its part of the model, then
the commands rank 0 sends, each before rank 0's own model call. It reports one line of JSON on
stdout once built ({"ready": sizes}) or failed ({"error": why}), and exits when its stdin, a pipe
from rank 0, ends: when rank 0 stops it, or dies.

    python -m inference_service.engine.rank_follower --rank R --port P --config JSON
"""

import argparse
import hashlib
import json
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from inference_service.adapters.adapter_image import AdapterImage
from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from inference_service.model.collectives import Collectives
from inference_service.model.forward_batch import SequenceInput
from inference_service.model.shard import Shard
from inference_service.torch_threads import per_rank
from shared import adapter_blob
from shared.errors import brief

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._verified: set[str] = set()  # digests whose blob was hashed in this process

    def serve(self) -> None:
        """Do rank 0's commands, for as long as this process lives."""
        while True:
            command = self.runner.parallel.broadcast_json()
            op = command["op"]
            if op == "forward":
                seqs = [SequenceInput(*row) for row in command["seqs"]]
                self.runner.forward(seqs, command["all_logits"], command["kernels"])
            elif op == "load":
                self._load(command)
            elif op == "clear":
                self.runner.clear_slot(command["slot"])
            elif op == "zero":
                self.runner.zero_blocks(command["blocks"])

    def _load(self, command: dict) -> None:
        """This rank's part of the adapter whose blob rank 0 names, into the pages it names."""
        runner, digest, blob = self.runner, command["digest"], Path(command["blob"])
        data = blob.read_bytes()
        if digest not in self._verified and "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"adapter blob {blob} does not hash to {digest}")
        self._verified.add(digest)
        where = f"adapter {command['name']!r}"
        weights = adapter_blob.decode(data, where, runner.model_config, runner.config.max_lora_rank)
        image = AdapterImage.of(
            weights, runner.model_config, runner.config.torch_dtype, runner.parallel.shard
        )
        pages = tuple(tuple(units) for units in command["pages"])
        runner.load_slot(command["slot"], image, pages)


def main() -> None:
    args = _parse()
    report = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)  # the protocol's lines
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything else printed goes to the log
    logging.basicConfig(level=logging.INFO, format=f"rank {args.rank}: %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_rank_0, name="rank-0-pipe", daemon=True).start()
    config = EngineConfig(**json.loads(args.config))
    size = config.tensor_parallel_size
    torch.set_num_threads(per_rank(size))
    if config.device == "cuda":
        torch.cuda.set_device(args.rank)
    try:
        shard = Shard(args.rank, size, config.fully_sharded_loras)
        parallel = Collectives.connect(shard, args.port, torch.device(config.device), config.step_timeout_s)
        runner = ModelRunner(config, parallel)
    except Exception as e:
        log.exception("could not start")
        print(json.dumps({"error": brief(e)}), file=report)
        sys.exit(1)
    print(json.dumps({"ready": runner.memory_report()}), file=report)
    try:
        Follower(runner).serve()  # until the pipe's thread ends the process
    except Exception:
        log.exception("a command failed; this rank stops, and rank 0's next collective fails")
        logging.shutdown()
        os._exit(1)


def _exit_with_rank_0() -> None:
    """Rank 0 holds the other end of stdin: when it ends, for whatever reason, so does this rank
    (at once: not the interpreter's shutdown, with the main thread inside a collective)."""
    sys.stdin.buffer.read()
    logging.shutdown()
    os._exit(0)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="one tensor-parallel rank of an inference worker (started by rank 0)"
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="loopback port of rank 0's TCPStore")
    p.add_argument("--config", required=True, help="the engine's EngineConfig, as JSON")
    return p.parse_args()


if __name__ == "__main__":
    main()

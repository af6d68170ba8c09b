"""Run a function on N tensor-parallel ranks, each a process of its own in one gloo group on
loopback, and return what rank 0 returned.

The ranks fork from a server process that imported the function's module once (multiprocessing's
forkserver): spawned afresh, each rank imported torch, the test module and what it imports
(transformers, torchao, bitsandbytes), several CPU seconds each, before its first op."""

import multiprocessing
import socket
import traceback

import torch

from inference_service.model.collectives import Collectives
from inference_service.model.shard import Shard


def run_ranks(size: int, fn, *args, fully_sharded: bool = False, timeout_s: float = 300):
    """fn(parallel, *args) on ranks 0..size-1 (parallel: that rank's Collectives, its adapters
    fully sharded or not); rank 0's result, or the first rank's error."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([fn.__module__])  # read when the server starts: the first call
    results = context.Queue()
    port = _free_port()
    ranks = [
        context.Process(target=_rank, args=(Shard(r, size, fully_sharded), port, results, fn, args))
        for r in range(size)
    ]
    for process in ranks:
        process.start()
    outcomes = {}
    try:
        while len(outcomes) < size:  # a failed rank is reported at once: the others may wait for it forever
            rank, outcome = results.get(timeout=timeout_s)
            if isinstance(outcome, _Failed):
                raise AssertionError(f"rank {rank} failed:\n{outcome.text}")
            outcomes[rank] = outcome
    finally:
        for process in ranks:
            process.join(timeout=10 if len(outcomes) == size else 0)
            if process.is_alive():
                process.kill()
    return outcomes[0]


class _Failed:
    def __init__(self, text: str):
        self.text = text


def _rank(shard: Shard, port: int, results, fn, args) -> None:
    torch.set_num_threads(1)  # N ranks share the machine's cores
    parallel = Collectives.connect(shard, port, torch.device("cpu"), timeout_s=60)
    try:
        outcome = fn(parallel, *args)
    except BaseException:
        outcome = _Failed(traceback.format_exc())
    results.put((shard.rank, outcome if shard.rank == 0 or isinstance(outcome, _Failed) else None))
    parallel.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

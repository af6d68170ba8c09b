"""Which threads run torch's CPU ops in parallel: the stepping thread, and no other for long.

torch's CPU build spreads an op over OpenMP threads, and each thread that runs a parallel op gets
a team of its own, which lives as long as that thread. libgomp counts the threads of every team:
once they outnumber the CPUs, all teams stop spinning at their barriers and sleep there instead,
and a step, thousands of short parallel ops, then waits on wake-ups (measured on 2 cores: an
engine stepping in its own thread ran 20-25% slower while the thread that built the model kept
its team). So background threads that touch tensors (adapter loads) run their ops alone, and the
engine builds its model and reads local adapters in threads that end (in_passing_thread).

torch keeps one process default for the threads of a thread's first op, and `set_num_threads`
changes it along with the calling thread's own setting; single_threaded and parallel leave it as it
was.
"""

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def single_threaded() -> None:
    """From now on torch runs this thread's ops on this thread alone."""
    default = torch.get_num_threads()  # torch sets this thread up first; it would undo what follows
    torch.set_num_threads(1)
    # The process default back, set from a thread that runs no op and ends at once.
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="torch-threads")
    restore.start()
    restore.join()


def parallel(threads: int) -> None:
    """From now on torch runs this thread's ops over `threads` threads, whatever the process
    default was when the thread began (another thread may be in single_threaded)."""
    torch.get_num_threads()  # torch sets this thread up first, from the process default
    torch.set_num_threads(threads)


def per_rank(ranks: int) -> int:
    """Threads each of `ranks` tensor-parallel processes on this machine runs its ops over: the
    CPUs shared evenly. Each process's OpenMP team spins at its barriers, unaware of the others:
    more threads than CPUs in all and every rank waits on the others' spinning."""
    return max(1, (os.cpu_count() or 1) // ranks)


def crowding(ranks: int) -> str | None:
    """Why `ranks` tensor-parallel processes would be slow on this machine's CPUs, or None. Past
    one rank a CPU, each collective waits for the OS to run the ranks it waits on: 3 ranks on 2
    CPUs waited about 3 ms a collective, some 60 of them a step of the default model."""
    cpus = os.cpu_count() or 1
    if ranks <= cpus:
        return None
    return (
        f"tensor_parallel_size {ranks} on {cpus} CPUs: the ranks share CPUs, and each of a step's "
        f"collectives waits for the OS to run the ranks it waits on (3 ranks on 2 CPUs: about 3 ms "
        f"a collective); at most {cpus} ranks keep a CPU each"
    )


def in_passing_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) in a thread that ends before this returns: the team its parallel ops got ends
    with it, rather than living on in the calling thread beside the stepping thread's."""
    with ThreadPoolExecutor(1, thread_name_prefix="torch-passing") as pool:
        return pool.submit(fn, *args).result()

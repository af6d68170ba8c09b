"""A store stopped while a worker watches it, as when a pod's two containers stop together, stops
quietly: its stop line, exit 0, nothing alarming."""

import signal
import subprocess
import sys
import time

import grpc

from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.adapter_store.conftest import REPO

# The stray traceback came from a race that about one stop in three lost, so one process serves
# and stops this many times (a store per stop would pay torch's import each time).
STOPS = 10
SERVE_AND_STOP = f"from adapter_store.__main__ import main\nfor _ in range({STOPS}):\n    main()"


def test_ctrl_c_while_a_worker_watches_prints_the_stop_line_and_no_traceback(tmp_path):
    log = tmp_path / "store.log"
    flags = ["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data")]
    with open(log, "w") as stderr:
        store = subprocess.Popen(
            [sys.executable, "-c", SERVE_AND_STOP, *flags],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        for _ in range(STOPS):
            address = store.stdout.readline().split()[-1]  # "adapter store listening on HOST:PORT"
            with grpc.insecure_channel(address) as channel:
                watch = pb_grpc.AdapterStoreStub(channel).WatchAdapters(pb.WatchAdaptersRequest())
                assert next(watch).type == pb.AdapterEvent.TYPE_SYNCED  # an empty catalog
                store.send_signal(signal.SIGINT)
                time.sleep(0.2)  # the worker, stopping too, ends its watch while the store stops
                watch.cancel()
        assert store.wait(timeout=15) == 0
    finally:
        store.kill()
    printed = log.read_text()
    assert printed.count("stopping: new calls are refused, calls in flight get 5 s") == STOPS
    for alarm in ("Traceback", "CancelledError", "Exception not handled"):
        assert alarm not in printed, printed

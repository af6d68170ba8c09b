"""The gRPC face of the worker: the server, the servicer, proto conversion, admission, the worker
config, the store watch, Prometheus metrics and the command line (main.py)."""

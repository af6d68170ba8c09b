"""The adapter store sidecar: sources, validation, optimization, catalog, gRPC servicer."""

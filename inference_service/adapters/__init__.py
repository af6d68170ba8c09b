"""The worker's side of the adapter store: the host-memory tier of ready adapters and the loaders that
fill it, from local PEFT folders or from the store over gRPC."""

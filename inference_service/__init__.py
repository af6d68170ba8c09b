"""The inference worker, in rooms that show its layers: model/ (the model runtime), engine/
(batching, scheduling, sampling), adapters/ (loading adapters into host memory), server/ (gRPC),
demo/ (the demo and its adapters)."""

"""The model runtime: the Llama-family model, attention, rope, LoRA linear, the per-step forward
batch, weight loading and the KV cache tensors. It knows nothing of requests."""

"""The inference worker: model runtime, LoRA layers, slot pool, scheduler, engine, gRPC servicer."""

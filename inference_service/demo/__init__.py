"""The demo (`make run`) and the training of the demo adapters it serves; nothing in the worker
imports it."""

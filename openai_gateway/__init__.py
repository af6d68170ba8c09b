"""The OpenAI-compatible HTTP gateway: OpenAI's API outward, the loramux SDK inward.

It holds no model and no adapter: every call becomes gRPC calls through `loramux.AsyncClient`, so
the adapter-affinity header reaches a router in front of the workers, and gateways scale apart
from them.
"""

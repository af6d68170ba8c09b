"""Python SDK and the `loramux` CLI (not built yet)."""

"""Code both services use: errors, model config, the adapter checkpoint rules and wire format."""

"""Optional backends that plug into the core after a model is loaded."""

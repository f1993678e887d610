"""ml_collections configs, one module per model family; each has `get_config(arg)`."""

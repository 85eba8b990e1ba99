"""One module per model family, each on the shared parts (model/parts.py, model/decoder.py); model/registry.py lists
them."""

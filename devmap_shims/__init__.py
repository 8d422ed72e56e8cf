"""devmap-shims: keep the Hugging Face stack placing tensors on the right GPU."""
__version__ = "0.1.0"

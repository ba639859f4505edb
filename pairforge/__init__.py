"""pairforge: image-text pretraining shards for unified autoregressive models."""

__version__ = "0.1.0"

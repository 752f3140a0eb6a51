"""hicache_lab: SGLang's hierarchical KV cache, small enough to read, real enough to break."""

__version__ = "0.1.0"

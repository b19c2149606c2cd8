"""kvshare: a shared host-memory KV-cache pool for LLM inference replicas."""

__version__ = "0.1.0"

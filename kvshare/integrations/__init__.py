"""Adapters that plug kvshare into inference engines it does not own (vLLM)."""

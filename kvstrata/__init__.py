"""kvstrata: a tiered cache server for LLM KV caches that speaks RESP."""

__version__ = "0.1.0"

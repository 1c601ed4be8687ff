"""lily: a fast, narrow inference engine and OpenAI-compatible server for Qwen3.6-35B-A3B."""

__version__ = "0.1.0"

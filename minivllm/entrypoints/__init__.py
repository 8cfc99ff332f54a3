"""Ways in from outside the process: the async engine front (`AsyncLLM`) and the
OpenAI-compatible HTTP server built on it (``minivllm serve``)."""

"""The OpenAI-compatible API: request/response models, routes, errors."""

"""Errors as the OpenAI API (and vLLM) sends them: an HTTP status and
``{"error": {"message", "type", "param", "code"}}``, ``code`` being the status."""

from __future__ import annotations

import logging

from minivllm.entrypoints.async_llm import EngineDeadError
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("minivllm.serve")

REQUEST_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class RequestError(ValueError):
    """Bad input with the request field to blame (``param``) and the status to answer."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {
        "error": {
            # A message may quote the request; a lone surrogate in it cannot be sent.
            "message": message.encode("utf-8", "backslashreplace").decode("utf-8"),
            "type": ERROR_TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def error_from_exception(error: Exception) -> tuple[int, dict]:
    """The status and body for an exception raised while serving a request.

    A ValueError is bad input (400). `SamplingParams` and the engine start their
    messages with the offending field ("temperature must be >= 0, got -1"), so that
    first word is the ``param``."""
    if isinstance(error, RequestError):
        return error.status, error_body(str(error), error.status, error.param)
    if isinstance(error, ValueError):
        message = str(error)
        first_word = message.split(" ", 1)[0]
        param = first_word if first_word in REQUEST_FIELDS else None
        return 400, error_body(message, 400, param)
    if isinstance(error, EngineDeadError):
        return 503, error_body(str(error), 503)
    logger.exception("request failed", exc_info=error)
    return 500, error_body(f"{type(error).__name__}: {error}", 500)

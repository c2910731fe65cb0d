"""The API's refusals: `ApiError` (an HTTP status and an OpenAI-style error object, so a client SDK
raises the right exception with our sentence in it), a domain error worded as one (`api_error`),
and the JSON response that carries it.

Owns: status codes, error types and codes, Retry-After. Must not word a failure itself (web/failures.py
does: a domain error's sentence, or a ref to the log) or decide what is an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from llmweb.errors import (
    AdmissionError,
    BusyError,
    Cancelled,
    ConfigError,
    EngineStopped,
    InputError,
    LlmwebError,
    OutOfMemory,
    TimedOut,
)
from llmweb.store.models import NotFound
from llmweb.web.failures import public_message

RETRY_AFTER_S = 2  # what a 429 / 503 tells the client to wait


class ApiError(Exception):
    """A refusal for the client: HTTP status, OpenAI error type and code, the parameter at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _retry() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def api_error(e: BaseException) -> ApiError:
    """A failure as the API reports it: a domain error's sentence, anything else a 500 whose message
    is only a ref to the log (web/failures.py)."""
    message = public_message(e)
    if not isinstance(e, LlmwebError):
        return ApiError(500, message, type="server_error")
    if isinstance(e, NotFound):
        return ApiError(404, message, type="not_found_error", code="conversation_not_found")
    if isinstance(e, InputError):
        return ApiError(400, message, code="invalid_input")
    if isinstance(e, BusyError):
        return ApiError(429, message, type="rate_limit_error", code="queue_full", headers=_retry())
    if isinstance(e, AdmissionError | OutOfMemory):
        return ApiError(503, message, type="server_error", code="out_of_memory", headers=_retry())
    if isinstance(e, TimedOut):
        return ApiError(504, message, type="server_error", code="timeout")
    if isinstance(e, Cancelled):
        return ApiError(503, message, type="server_error", code="cancelled", headers=_retry())
    if isinstance(e, EngineStopped):  # the model's process died under it and is restarting: retry
        return ApiError(503, message, type="server_error", code="engine_stopped", headers=_retry())
    if isinstance(e, ConfigError):
        return ApiError(500, message, type="server_error", code="configuration")
    return ApiError(500, message, type="server_error")


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

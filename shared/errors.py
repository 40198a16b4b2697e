"""One error hierarchy for the whole system; the gateway maps it to OpenAI's error shape once."""
from __future__ import annotations


class KvgateError(Exception):
    """An error a client should see: HTTP status, OpenAI error type and code, offending param, and
    headers its response carries (a 429's x-ratelimit-*, the version that answered)."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def with_headers(self, headers: dict[str, str]) -> "KvgateError":
        """The same error, its response also carrying `headers` (added to those it has)."""
        self.headers = {**self.headers, **headers}
        return self

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class InvalidRequest(KvgateError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class InvalidStructuredOutput(InvalidRequest):
    """A structured-output constraint that does not compile (or not in time, or too large): found by
    the gateway's check before queueing, or by the worker's compile."""

    code = "invalid_structured_output"


class AuthenticationFailed(KvgateError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class PermissionDenied(KvgateError):
    status, type, code = 403, "permission_error", "model_not_allowed"


class NotFound(KvgateError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class Conflict(KvgateError):
    status, type, code = 409, "invalid_request_error", "conflict"


class PayloadTooLarge(KvgateError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class Unprocessable(KvgateError):
    status, type, code = 422, "invalid_request_error", "invalid_value"


class UnsupportedMediaType(KvgateError):
    """A body the gateway cannot read as sent: not JSON where JSON is asked for, or compressed."""

    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class RateLimited(KvgateError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class Overloaded(KvgateError):
    status, type, code = 503, "overloaded_error", "service_unavailable"


class RequestTimeout(KvgateError):
    status, type, code = 504, "timeout_error", "timeout"


class ClientNotReading(InvalidRequest):
    """A streamed request whose client left more replies unread than the gateway keeps for it
    (gateway/reply_queue.py): it ends, the worker told to stop, as the client reads on."""

    code = "client_not_reading"


class ClientTooSlow(KvgateError):
    """The client sent no more of its request's body within KVGATE_CLIENT_READ_TIMEOUT_S."""

    status, type, code = 408, "invalid_request_error", "request_timeout"


class QuotaExceeded(KvgateError):
    """A stored-data quota of the key (files, bytes, batches in progress); retrying does not help
    until something is deleted or finishes."""

    status, type, code = 429, "insufficient_quota", "quota_exceeded"


class EngineFailure(KvgateError):
    status, type, code = 500, "server_error", "engine_error"


class RequestFailed(EngineFailure):
    """One request failed in a worker for a reason nobody named (an exception on its own row of the
    sampler, in its own template or detokenizer) while the engine served the rest: most likely its
    content's doing, so it is not sent again, and it does not count against the version's circuit
    breaker — one tenant's requests must not open it for every tenant (gateway/breaker.py). The
    canary analysis still counts it as an error."""

    code = "request_failed"


class EngineStepFailed(Overloaded):
    """A batched engine step failed in a way no single request could be blamed for: every request
    in it ends with this, the engine resets and goes on; sending the request again may succeed."""

    code = "engine_step_failed"


class ResumeFailed(Overloaded):
    """A request taken over from a dead worker could not be resumed (its checkpoint unreadable or
    over its cap); sending it again may succeed."""

    code = "resume_failed"


class RequestFailedRepeatedly(EngineFailure):
    """The poison cap: the entry was delivered to workers N times and never finished, so it is
    answered with this instead of being handed to another worker."""

    code = "request_failed_repeatedly"


class UnsupportedSchema(EngineFailure):
    """A message between gateway and worker in a schema version the reader does not speak."""

    code = "unsupported_schema"


_BY_CODE = {cls.code: cls for cls in (InvalidRequest, ContextLengthExceeded, InvalidStructuredOutput,
                                      AuthenticationFailed, PermissionDenied, NotFound, Conflict,
                                      PayloadTooLarge, Unprocessable,
                                      RateLimited, Overloaded, RequestTimeout, EngineFailure, RequestFailed,
                                      QuotaExceeded, EngineStepFailed, ResumeFailed,
                                      RequestFailedRepeatedly, UnsupportedSchema)}


def from_code(code: str | None, message: str, param: str | None = None,
              retryable: bool = False) -> KvgateError:
    """Rebuild an error that crossed Redis (worker → gateway) from its code; an unknown code is an
    engine failure, or overload (503) when the worker said a retry may succeed."""
    default = Overloaded if retryable else EngineFailure
    exc = _BY_CODE.get(code, default)(message, param=param, code=code)
    if exc.status == 503 and exc.retry_after is None:
        exc.retry_after = 1
    return exc

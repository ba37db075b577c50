"""kvroute's exception tree, and the OpenAI-style error body every JSON error of kvroute carries
(:func:`error_body`). Foreign errors are mapped into the tree at one boundary each
(``gateway/upstream.py`` for the replica client, ``store/redis/_wire.py::map_redis_errors``), and
``gateway/middleware.py`` maps it to HTTP status + :func:`error_body`.

    KvrouteError
    ├── ConfigError                  bad configuration (names the key)
    ├── RequestError                 the client's fault -> 4xx
    │   ├── BadRequestError          400 invalid_request_error
    │   ├── PayloadTooLargeError     413
    │   ├── NotFoundError            404
    │   └── UnauthorizedError        401
    ├── NoReplicaError               503: nothing eligible to route to
    ├── UpstreamError                a replica failed
    │   ├── UpstreamConnectError     connect refused / reset before the first byte (retryable)
    │   ├── UpstreamStatusError      5xx before the first byte (retryable)
    │   ├── UpstreamTimeoutError     no answer in time (retryable before the first byte)
    │   └── UpstreamBrokenError      stream broke after bytes reached the client (not retryable)
    ├── StoreError                   shared-state backend unavailable (gateway degrades, never fails)
    └── StaleViewError               the store refused a decision made on an outdated view: route again
        ├── ReplicaNotFoundError     the replica named is not (or no longer) registered
        └── StaleSessionError        another gateway moved the session and its real home cannot take
                                     the request; nothing was applied
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadRequestError",
    "ConfigError",
    "KvrouteError",
    "NoReplicaError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ReplicaNotFoundError",
    "RequestError",
    "StaleSessionError",
    "StaleViewError",
    "StoreError",
    "UnauthorizedError",
    "UpstreamBrokenError",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeoutError",
    "error_body",
]


def error_body(message: str, error_type: str, code: str | int) -> dict[str, Any]:
    """``{"type": "error", "error": {"message", "type", "code"}}``: what an OpenAI-compatible client
    parses, and an Anthropic one (Messages API) too."""
    return {"type": "error", "error": {"message": message, "type": error_type, "code": code}}


class KvrouteError(Exception):
    status: int = 500
    error_type: str = "internal_error"
    code: str = "internal_error"


class ConfigError(KvrouteError):
    pass


class RequestError(KvrouteError):
    status = 400
    error_type = "invalid_request_error"
    code = "bad_request"


class BadRequestError(RequestError):
    pass


class PayloadTooLargeError(RequestError):
    status = 413
    code = "payload_too_large"


class NotFoundError(RequestError):
    status = 404
    code = "not_found"


class UnauthorizedError(RequestError):
    status = 401
    error_type = "authentication_error"
    code = "unauthorized"


class NoReplicaError(KvrouteError):
    status = 503
    error_type = "service_unavailable"
    code = "no_replica"


class UpstreamError(KvrouteError):
    status = 502
    error_type = "upstream_error"
    code = "upstream_error"
    retryable = True


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamStatusError(UpstreamError):
    code = "upstream_status"

    def __init__(self, message: str, upstream_status: int = 502, body: bytes = b"") -> None:
        super().__init__(message)
        self.upstream_status = upstream_status
        self.body = body


class UpstreamTimeoutError(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamBrokenError(UpstreamError):
    code = "upstream_stream_broken"
    retryable = False


class StoreError(KvrouteError):
    status = 503
    code = "store_unavailable"


class StaleViewError(KvrouteError):
    status = 503
    error_type = "service_unavailable"
    code = "stale_view"


class ReplicaNotFoundError(StaleViewError):
    status = 404
    error_type = "invalid_request_error"
    code = "replica_not_found"

    def __init__(self, replica_id: str) -> None:
        super().__init__(f"replica {replica_id!r} is not registered")
        self.replica_id = replica_id


class StaleSessionError(StaleViewError):
    code = "stale_session"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} moved under this decision")
        self.session_id = session_id

"""JSON structured logs with a request id, and redaction of secrets.

Rules:
  1. One JSON object per line on the configured stream: ``ts`` (wall clock, ISO 8601 UTC), ``level``,
     ``logger``, ``msg``, ``request_id`` (when inside a request), plus any ``extra={...}`` fields.
  2. The request id lives in a ``contextvars.ContextVar``: set it once per request (the gateway's
     middleware does, or :func:`request_id_scope`), and every log line in that task carries it.
  3. Secrets never reach a log line: header/field names that look like credentials
     (``authorization``, ``*token*``, ``*api-key*``, ``cookie``, ``password``, ``secret``,
     ``credential``) are replaced by ``"[REDACTED]"``, and ``Bearer xxx`` inside free text is masked.
     Token *counts* are not secrets: a name with ``tokens`` (``capacity_tokens``, ``prompt_tokens``,
     ``tokens_written``) or ``tokenizer`` is logged as is.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import IO, Any

__all__ = [
    "REDACTED",
    "JsonFormatter",
    "configure_logging",
    "current_request_id",
    "redact",
    "redact_text",
    "redact_url",
    "request_id_scope",
    "set_request_id",
]

REDACTED = "[REDACTED]"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvroute_request_id", default=None)

# ``token`` names a credential (admin_token, X-Auth-Token, accessToken), ``tokens`` a count
# (capacity_tokens, prompt_tokens, tokens_written) and ``tokeniz...`` a tokenizer: only the first is
# redacted, so counts stay readable in the logs
_TOKEN = r"token(?!s|i[sz])"
_SECRET_NAME = re.compile(
    rf"(authorization|{_TOKEN}|api[-_]?key|cookie|password|secret|credential)", re.IGNORECASE
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+")
# ``name=value`` / ``Name: value`` pairs; ``authorization`` and ``cookie`` too, since a header line
# quoted in an error (aiohttp's parser quotes the line it refuses) may carry a key without a scheme
_KV_SECRET = re.compile(
    rf"(?i)\b([a-z_-]*(?:{_TOKEN}|api[-_]?key|password|secret|authorization|cookie)[a-z_-]*)"
    r"(\s*[=:]\s*)(?!(?:bearer|basic)\s)([^\s&,;\"']+)"
)

# ``scheme://user:password@host``: shown as ``scheme://***@host`` (a Redis URL carries its password,
# and start-up errors are printed on stderr, which log collectors keep)
_USERINFO = re.compile(r"(//)[^/@\s'\"]*@")

# Attributes every LogRecord has: anything else on a record came from ``extra=`` and is emitted.
_RESERVED = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
    | {"message", "asctime", "taskName"}
)


def current_request_id() -> str | None:
    return _request_id.get()


def set_request_id(request_id: str | None) -> contextvars.Token[str | None]:
    return _request_id.set(request_id)


@contextlib.contextmanager
def request_id_scope(request_id: str) -> Iterator[str]:
    token = _request_id.set(request_id)
    try:
        yield request_id
    finally:
        _request_id.reset(token)


def redact_text(text: str) -> str:
    """Mask bearer credentials and ``token=...``-style pairs inside free text."""
    text = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    return _KV_SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def redact_url(text: str) -> str:
    """``text`` with the user-info of every URL in it masked (``redis://***@host:6379/0``)."""
    return _USERINFO.sub(r"\1***@", text)


def redact(value: Any, _depth: int = 0) -> Any:
    """A copy of ``value`` with secret-looking keys replaced (mappings, lists, headers)."""
    if _depth > 8:
        return value
    if isinstance(value, Mapping):
        return {
            str(k): (REDACTED if _SECRET_NAME.search(str(k)) else redact(v, _depth + 1))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v, _depth + 1) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line; see the module docstring for the fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact_text(record.getMessage()),
        }
        rid = _request_id.get()
        if rid is not None:
            out["request_id"] = rid
        for key, val in record.__dict__.items():
            if key in _RESERVED or key.startswith("_"):
                continue
            out[key] = REDACTED if _SECRET_NAME.search(key) else redact(val)
        if record.exc_info:
            out["exc"] = redact_text(self.formatException(record.exc_info))
        return json.dumps(out, default=str, separators=(",", ":"))


def configure_logging(
    level: str | int = "info", stream: IO[str] | None = None, logger: str = ""
) -> logging.Handler:
    """Install one JSON handler on ``logger`` (root by default); replaces a previous one of ours."""
    target = logging.getLogger(logger)
    for h in list(target.handlers):
        if getattr(h, "_kvroute_json", False):
            target.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler._kvroute_json = True  # type: ignore[attr-defined]
    target.addHandler(handler)
    target.setLevel(level.upper() if isinstance(level, str) else level)
    return handler

"""Reading what a client sent: JSON bodies and session ids, with OpenAI-style 400s for what is bad."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import orjson

from router.config import GatewayConfig
from router.errors import BadRequestError

__all__ = ["RESPONSE_ID", "body_field", "body_string", "checked_session_id", "parse_body"]

# the shape of a Responses API id SGLang makes ("resp_" + 32 hex digits): an id of any other shape is
# never pinned, looked up or read back from an engine
RESPONSE_ID = "resp_[A-Za-z0-9_-]{1,200}"


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)  # several times faster than json; refuses a few things json takes
    except orjson.JSONDecodeError:
        try:
            obj = json.loads(body)  # integers over 64 bits, NaN: what json accepted stays accepted
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequestError(f"request body is not valid JSON: {exc}") from None
        except RecursionError:  # orjson's depth limit is 1024, json's is the interpreter's stack
            raise BadRequestError("request body is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise BadRequestError("request body must be a JSON object")
    return obj


def body_field(body: bytes, key: str) -> Any:
    """The top-level ``key`` of a JSON body, parsed only when the bytes mention it; ``None`` when
    absent or when the body does not parse (the replica judges such a body, as any request)."""
    if f'"{key}"'.encode() not in body:
        return None
    try:
        return parse_body(body).get(key)
    except BadRequestError:
        return None


def body_string(body: bytes, key: str) -> str | None:
    """``body_field`` when it is a non-empty string, else ``None``."""
    value = body_field(body, key)
    return value if isinstance(value, str) and value else None


def checked_session_id(name: str, value: str, cfg: GatewayConfig) -> str:
    """``value`` if it is a session id the limits allow; ``BadRequestError`` naming ``name`` if not."""
    limit = cfg.limits.max_session_id_len
    if len(value) > limit:
        raise BadRequestError(f"{name}: session id longer than {limit} characters")
    if not _compiled(cfg.limits.session_id_pattern).match(value):
        raise BadRequestError(f"{name}: session id has characters outside {cfg.limits.session_id_pattern}")
    if not value.isascii():
        # header bytes that are not UTF-8 reach us as lone surrogates (a JSON body can carry them as
        # escapes); a widened pattern may let them through, and the Redis store (and the forwarded
        # header) cannot encode them
        try:
            value.encode()
        except UnicodeEncodeError:
            raise BadRequestError(f"{name}: session id is not valid UTF-8") from None
    return value


@functools.lru_cache(maxsize=8)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)

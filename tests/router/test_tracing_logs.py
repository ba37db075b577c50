"""JSON structured logs: one object per line, request id from the context, secrets redacted."""

from __future__ import annotations

import asyncio
import io
import json
import logging

from router.observability.logging import (
    REDACTED,
    configure_logging,
    redact,
    redact_text,
    request_id_scope,
)


def _lines(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_json_lines_with_request_id_and_extra_fields() -> None:
    buf = io.StringIO()
    handler = configure_logging("debug", stream=buf, logger="kvroute.test.logs")
    log = logging.getLogger("kvroute.test.logs")
    try:
        log.info("outside")
        with request_id_scope("req-123"):
            log.info("routed %s", "r1", extra={"replica": "r1", "reason": "affinity"})
        out = _lines(buf)
    finally:
        log.removeHandler(handler)
    assert out[0]["msg"] == "outside" and "request_id" not in out[0]
    assert out[1]["msg"] == "routed r1"
    assert out[1]["request_id"] == "req-123"
    assert out[1]["replica"] == "r1" and out[1]["reason"] == "affinity"
    assert out[1]["level"] == "info" and out[1]["logger"] == "kvroute.test.logs"


async def test_request_id_is_per_task() -> None:
    buf = io.StringIO()
    handler = configure_logging("info", stream=buf, logger="kvroute.test.tasks")
    log = logging.getLogger("kvroute.test.tasks")

    async def one(rid: str) -> None:
        with request_id_scope(rid):
            await asyncio.sleep(0)
            log.info("hello", extra={"who": rid})

    try:
        await asyncio.gather(*(one(f"r{i}") for i in range(5)))
    finally:
        log.removeHandler(handler)
    out = _lines(buf)
    assert len(out) == 5
    assert all(line["request_id"] == line["who"] for line in out)


def test_secrets_are_redacted() -> None:
    buf = io.StringIO()
    handler = configure_logging("info", stream=buf, logger="kvroute.test.redact")
    log = logging.getLogger("kvroute.test.redact")
    try:
        log.info(
            "upstream said Authorization: Bearer sk-live-abc123 and api_key=hunter2",
            extra={
                "headers": {"Authorization": "Bearer sk-live-abc123", "X-Admin-Token": "t0k", "Accept": "x"},
                "admin_token": "t0k",
            },
        )
    finally:
        log.removeHandler(handler)
    raw = buf.getvalue()
    assert "sk-live-abc123" not in raw and "hunter2" not in raw and "t0k" not in raw
    line = _lines(buf)[0]
    assert line["headers"] == {"Authorization": REDACTED, "X-Admin-Token": REDACTED, "Accept": "x"}
    assert line["admin_token"] == REDACTED


def test_redact_helpers() -> None:
    assert redact({"a": [{"password": "p"}], "b": 1}) == {"a": [{"password": REDACTED}], "b": 1}
    assert redact_text("Bearer abc.def") == f"Bearer {REDACTED}"
    assert "zzz" not in redact_text("url?token=zzz&x=1")

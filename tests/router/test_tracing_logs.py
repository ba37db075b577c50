"""JSON structured logs: one object per line, request id from the context, secrets redacted."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from typing import Any

from router.observability.logging import (
    REDACTED,
    configure_logging,
    redact,
    redact_text,
    request_id_scope,
)
from tests.router.test_metrics_functional import stack_factory

__all__ = ["stack_factory"]  # fixture shared with the metrics tests


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


def test_token_counts_are_not_redacted_but_credentials_are() -> None:
    """The sidecar's ``registered`` line showed capacity_tokens as [REDACTED]: ``*token*`` caught counts.
    Credentials named with ``token`` stay redacted; ``*_tokens`` counts and the tokenizer do not."""
    buf = io.StringIO()
    handler = configure_logging("info", stream=buf, logger="kvroute.test.counts")
    log = logging.getLogger("kvroute.test.counts")
    try:
        log.info(
            "usage prompt_tokens=812 max_tokens: 64 with access_token=sekrit1 and X-Auth-Token: sekrit2",
            extra={
                "spec": {"capacity_tokens": 850000, "host_capacity_tokens": 4000000, "tp_size": 4},
                "usage": {"prompt_tokens": 812, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 7}},
                "tokens_written": 99,
                "tokenizer_path": "/models/k2",
                "admin_token": "sekrit3",
                "headers": {"X-Auth-Token": "sekrit4", "x-api-key": "sekrit5", "Cookie": "sekrit6"},
                "creds": {"accessToken": "sekrit7", "password": "sekrit8", "client_secret": "sekrit9"},
            },
        )
    finally:
        log.removeHandler(handler)
    raw = buf.getvalue()
    assert "sekrit" not in raw, raw
    line = _lines(buf)[0]
    assert line["spec"] == {"capacity_tokens": 850000, "host_capacity_tokens": 4000000, "tp_size": 4}
    assert line["usage"] == {
        "prompt_tokens": 812, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 7}
    }
    assert line["tokens_written"] == 99 and line["tokenizer_path"] == "/models/k2"
    assert line["admin_token"] == REDACTED
    assert line["headers"] == {"X-Auth-Token": REDACTED, "x-api-key": REDACTED, "Cookie": REDACTED}
    assert line["creds"] == {"accessToken": REDACTED, "password": REDACTED, "client_secret": REDACTED}
    assert "prompt_tokens=812" in str(line["msg"]) and "max_tokens: 64" in str(line["msg"])


async def test_gateway_log_lines_carry_the_request_id(stack_factory: Any) -> None:
    """Through the live gateway: a retry logged inside a request carries that request's id."""
    import asyncio

    import aiohttp

    from tests.router.test_metrics_functional import send

    # no active health checks during the test: the dead replica is found by the requests themselves
    st = await stack_factory(2, health={"health_interval_s": 60.0})
    buf = io.StringIO()
    handler = configure_logging("info", stream=buf, logger="kvroute")
    try:
        await st.replicas[0].stop()  # connection refused: the first attempt on it fails and is retried
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(*(send(s, st.gateway.url, f"log-{i}", 0) for i in range(8)))
        assert all(code == 200 for code, _ in results)
        ids = [hdrs["X-Request-Id"] for _, hdrs in results]
    finally:
        logging.getLogger("kvroute").removeHandler(handler)
    retries = [line for line in _lines(buf) if str(line["msg"]).startswith("retrying after")]
    assert retries, buf.getvalue()[-2000:]
    assert all(line["request_id"] in ids for line in retries)

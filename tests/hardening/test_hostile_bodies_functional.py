"""Request bodies and session ids that reach the gateway's own parsing and hashing (review of the hot path).

The gateway parses a body only to key it (no session header: ``prefix_key``; a session split across
replicas: ``chain_key``) and hashes keys with mmh3. Whatever a client sends there, the answer is a
clean 4xx or the replica's own answer - never a 500, never a dead gateway:

- a JSON string escape of a lone surrogate (``"\\ud800"``): ``orjson`` refuses it, ``json`` accepts it,
  and mmh3 5.x dereferences NULL when handed a ``str`` it cannot encode as UTF-8 (a segfault, the
  whole gateway gone);
- a session id with bytes that are not UTF-8 (aiohttp hands them on as surrogate escapes), under a
  ``limits.session_id_pattern`` that lets them through: the same crash in rendezvous hashing;
- JSON nested deeper than Python's recursion limit: ``RecursionError`` from ``json`` (parsing) or
  from rendering the prompt's anchor, a 500 before.

The gateway runs as a ``kvroute serve`` subprocess: a crash shows as a failed test, not a dead pytest.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from loadtests.procs import Procs, read_line

CHAT = "/v1/chat/completions"
OK_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
).encode()
# a lone surrogate as a JSON escape: valid for ``json``, refused by ``orjson``
SURROGATE_CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi \\ud800"}],"max_tokens":3}'
SURROGATE_PROMPT = b'{"model":"m","prompt":"hi \\udfff there","max_tokens":3}'
DEEP_INVALID = b"[" * 100_000 + b"]" * 100_000  # deeper than json's recursion limit
# valid for orjson (depth < 1024), too deep for json.dumps when the anchor is rendered
DEEP_CONTENT = (
    b'{"model":"m","max_tokens":3,"messages":[{"role":"user","content":{"a":'
    + b"[" * 990
    + b"]" * 990
    + b"}}]}"
)
# the same in a Responses API body (Codex's route): its anchor reads ``input`` as messages
DEEP_RESPONSES = b'{"model":"m","input":[{"role":"user","content":{"a":' + b"[" * 990 + b"]" * 990 + b"}}]}"


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    p.cleanup()


async def _serve(procs: Procs, replica_url: str, *args: str) -> tuple[str, Any]:
    p = procs.start(
        [sys.executable, "-m", "router.cli", "serve", "--port", "0", "--replica", replica_url,
         "--set", "health.health_interval_s=0.1", *args],
        stderr_pipe=True,
    )  # fmt: skip
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        line = await read_line(p.stderr, 30)
        if "gateway listening on" in line:
            procs.drain(p)
            return line.rsplit(" ", 1)[-1].strip(), p
        if not line or asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"kvroute serve did not start: {line!r}")


async def _post(
    url: str, body: bytes, headers: dict[str, str] | None = None, route: str = CHAT
) -> tuple[int, bytes]:
    h = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url + route, data=body, headers=h) as r:
        data = await r.read()
        if r.status >= 500:  # the test replica's own 500 (its json.loads recursing) is relayed, not ours
            assert "X-Kvroute-Error" not in r.headers and "X-Kvroute-Replica" in r.headers, (
                r.status,
                data[:300],
            )
            return 299, b""
        return r.status, data


async def _wait_ready(url: str) -> None:
    for _ in range(200):
        status, _ = await _post(url, OK_BODY)
        if status == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("gateway never served")


async def _gateway_on_one_replica(fake_replicas: Any, procs: Procs, *args: str) -> tuple[Any, str, Any]:
    """One test replica and a gateway in front of it that has served a first request."""
    (rep,) = await fake_replicas(1)
    url, p = await _serve(procs, rep.url, *args)
    await _wait_ready(url)
    return rep, url, p


async def _raw(port: int, raw: bytes, timeout_s: float = 10.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(raw)
        await w.drain()
        data = b""
        while chunk := await asyncio.wait_for(r.read(65536), timeout_s):
            data += chunk
        return data
    except ConnectionError:
        return b""
    finally:
        w.close()


def _assert_alive(p: Any) -> None:
    try:
        p.wait(timeout=0.5)  # a crashed process is reaped here
    except subprocess.TimeoutExpired:  # still running
        return
    assert p.poll() is None, f"the gateway died (exit status {p.returncode})"


def _assert_clean(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:300])  # a 5xx of the gateway's own fails in _post
    if status >= 400:
        obj = json.loads(body)
        assert isinstance(obj.get("error") or obj.get("message"), dict | str), body[:300]


@pytest.mark.parametrize(
    "body", [SURROGATE_CHAT, SURROGATE_PROMPT, DEEP_INVALID, DEEP_CONTENT, DEEP_RESPONSES],
    ids=["surrogate-chat", "surrogate-prompt", "deep-invalid", "deep-content", "deep-responses"],
)  # fmt: skip
async def test_hostile_body_without_session_gets_a_clean_answer(
    fake_replicas: Any, procs: Procs, body: bytes
) -> None:
    _, url, p = await _gateway_on_one_replica(fake_replicas, procs)
    try:
        route = {id(SURROGATE_PROMPT): "/v1/completions", id(DEEP_RESPONSES): "/v1/responses"}.get(id(body), CHAT)
        status, answer = await _post(url, body, route=route)
    except aiohttp.ClientError as exc:
        _assert_alive(p)
        raise AssertionError(f"no answer: {exc!r}") from exc
    _assert_clean(status, answer)
    if body is DEEP_INVALID:  # not JSON the gateway can read: its own 400
        assert status == 400 and json.loads(answer)["error"]["code"] == "bad_request"
    _assert_alive(p)
    assert (await _post(url, OK_BODY))[0] == 200


@pytest.mark.parametrize(
    "body", [SURROGATE_CHAT, DEEP_INVALID, DEEP_CONTENT], ids=["surrogate", "deep-invalid", "deep-content"]
)
async def test_hostile_body_of_a_split_session_is_the_replicas_to_judge(
    fake_replicas: Any, procs: Procs, body: bytes
) -> None:
    # a session with a request in flight makes the gateway parse the next one's body (chain_key)
    rep, url, p = await _gateway_on_one_replica(fake_replicas, procs)
    sid = {"Modal-Session-Id": "thicc-1"}
    assert (await _post(url, OK_BODY, sid))[0] == 200  # the session has a home
    rep.state.first_delay_s = 1.0
    slow = asyncio.create_task(_post(url, OK_BODY, sid))
    await asyncio.sleep(0.3)  # in flight now
    rep.state.first_delay_s = 0.0
    try:
        status, answer = await _post(url, body, sid)
    except aiohttp.ClientError as exc:
        _assert_alive(p)
        raise AssertionError(f"no answer: {exc!r}") from exc
    _assert_clean(status, answer)
    assert (await slow)[0] == 200
    _assert_alive(p)


async def test_session_id_bytes_that_are_not_utf8_never_crash_the_gateway(
    fake_replicas: Any, procs: Procs
) -> None:
    # an operator widens the session id pattern (non-ASCII ids): bytes that are not UTF-8 get through it
    _, url, p = await _gateway_on_one_replica(
        fake_replicas, procs, "--policy", "hash", "--set", r"limits.session_id_pattern=^\S+$"
    )
    port = int(url.rsplit(":", 1)[1])
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Modal-Session-Id: ab\xffcd\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(OK_BODY)).encode() + b"\r\n\r\n" + OK_BODY
    )
    answer = await _raw(port, raw)
    await asyncio.sleep(0.2)
    _assert_alive(p)
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    assert int(answer.split(b" ", 2)[1]) < 500, answer[:300]


@pytest.mark.parametrize(
    "body",
    [b'{"text": ""}', b'{"text": ["a", ""]}', b'{"input_ids": []}', b'{"text": "", "stream": true}'],
    ids=["empty-text", "empty-in-batch", "empty-ids", "empty-text-stream"],
)
async def test_empty_generate_input_never_reaches_a_replica(fake_replicas: Any, procs: Procs, body: bytes) -> None:
    # a real SGLang 0.5.23 exits on {"text": ""} (its scheduler reshapes 0 elements), and a retry of
    # the dropped connection took the next replica down with it: the gateway refuses it itself
    rep, url, p = await _gateway_on_one_replica(fake_replicas, procs)
    seen = len(rep.state.requests)
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", data=body) as r:
        status, answer = r.status, await r.json()
    assert status == 400 and answer["error"]["code"] == "bad_request", answer
    assert "empty" in answer["error"]["message"]
    assert len(rep.state.requests) == seen  # nothing proxied
    ok = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", data=ok) as r:
        assert r.status == 200
    assert len(rep.state.requests) == seen + 1
    _assert_alive(p)

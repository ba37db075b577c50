"""Request smuggling and framing against the gateway's listener, over raw sockets.

Every case gets a clean 400 (OpenAI-style JSON, then the connection closes) or a correct answer - and
never a desynchronised connection: after a correct answer, a well-formed request on the same
connection gets its own correct answer, and no replica ever sees a request the client did not send
as one whole request.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httptools
import pytest

from router.config import LimitsConfig

LIMITS = LimitsConfig()
PATH = "/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
SESSION = b"Modal-Session-Id: framing\r\n"


def post(body: bytes = BODY, extra: bytes = b"", target: bytes = PATH.encode(), version: bytes = b"1.1") -> bytes:
    return (
        b"POST " + target + b" HTTP/" + version + b"\r\nHost: gw\r\n" + SESSION
        + b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body) + extra + b"\r\n" + body
    )  # fmt: skip


def chunked(body: bytes = BODY, te: bytes = b"Transfer-Encoding: chunked\r\n", chunks: bytes | None = None) -> bytes:
    payload = chunks if chunks is not None else b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: gw\r\n" + SESSION + te + b"\r\n" + payload


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""


@dataclass
class _Parse:
    answers: list[Answer] = field(default_factory=list)
    _headers: dict[str, str] = field(default_factory=dict)
    _body: bytearray = field(default_factory=bytearray)
    parser: Any = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if status >= 200:
            self.answers.append(Answer(status, self._headers, bytes(self._body)))
        self._headers, self._body = {}, bytearray()


async def talk(url: str, *writes: bytes, pause_s: float = 0.0, idle_s: float = 1.5) -> tuple[list[Answer], bool]:
    """Send ``writes`` on one connection (``pause_s`` between them); read until the server closes or
    is quiet for ``idle_s``. Returns the parsed answers and whether the server closed."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    for i, data in enumerate(writes):
        if i and pause_s:
            await asyncio.sleep(pause_s)
        writer.write(data)
        try:
            await writer.drain()
        except ConnectionError:
            break
    raw = bytearray()
    closed = False
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), idle_s)
        except TimeoutError:
            break
        except ConnectionError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        raw += chunk
    writer.close()
    p = _Parse()
    p.parser = httptools.HttpResponseParser(p)
    p.parser.feed_data(bytes(raw))  # what the gateway wrote parses as whole HTTP/1.1 answers
    return p.answers, closed


def _ok(a: Answer) -> None:
    assert a.status == 200, a
    doc = json.loads(a.body)
    assert doc["object"] == "chat.completion" and doc["choices"]


def _refused(answers: list[Answer], closed: bool) -> None:
    assert len(answers) == 1 and closed, (answers, closed)
    a = answers[0]
    assert a.status == 400 and a.headers.get("content-type", "").startswith("application/json"), a
    err = json.loads(a.body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


@dataclass
class Target:
    url: str
    replica: Any  # tests.router.conftest.FakeReplica


@pytest.fixture
async def gateway(fake_replicas: Any, gateway_factory: Any) -> Target:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], downstream={"keepalive_s": 1.0})
    return Target(gw.url, rep)


# ---- refused: a clean 400, then the connection closes ----------------------------------------------

REFUSED = {
    "CL and TE": post(extra=b"Transfer-Encoding: chunked\r\n"),
    "TE and CL (CL.TE smuggle)": (
        b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: gw\r\n" + SESSION
        + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG"
    ),
    "two different Content-Lengths": post(extra=b"Content-Length: 3\r\n"),
    "Content-Length not a number": post(extra=b"").replace(b"Content-Length: ", b"Content-Length: +", 1),
    "negative Content-Length": post(body=b"").replace(b"Content-Length: 0", b"Content-Length: -1"),
    "TE with a coding other than chunked": chunked(te=b"Transfer-Encoding: xchunked\r\n"),
    "TE chunked not last": chunked(te=b"Transfer-Encoding: chunked, identity\r\n"),
    "TE with a space before the colon": chunked(te=b"Transfer-Encoding : chunked\r\n"),
    "TE folded (obs-fold)": chunked(te=b"Transfer-Encoding:\r\n chunked\r\n"),
    "obs-fold in another header": post(extra=b"X-Folded: a\r\n b\r\n"),
    "bad chunk size": chunked(chunks=b"zz\r\n" + BODY + b"\r\n0\r\n\r\n"),
    "negative chunk size": chunked(chunks=b"-5\r\nhello\r\n0\r\n\r\n"),
    "chunk size overflow": chunked(chunks=b"fffffffffffffffffffff\r\nhello\r\n0\r\n\r\n"),
    "chunk data longer than its size": chunked(chunks=b"2\r\nhello\r\n0\r\n\r\n"),
    "bare LF line ends": post().replace(b"\r\n", b"\n"),
    "bare CR in a header": post(extra=b"X-A: a\rb\r\n"),
    "NUL in a header value": post(extra=b"X-A: a\x00b\r\n"),
    "space in a header name": post(extra=b"X A: b\r\n"),
    "request line over the limit": post(target=b"/" + b"a" * (LIMITS.max_line_size + 1)),
    "header over the limit": post(extra=b"X-Big: " + b"a" * (LIMITS.max_field_size + 1) + b"\r\n"),
    "two identical Content-Lengths": post(extra=b"Content-Length: %d\r\n" % len(BODY)),
    "too many headers": post(extra=b"".join(b"X-%d: v\r\n" % i for i in range(LIMITS.max_headers + 1))),
    "not HTTP at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}


@pytest.mark.parametrize("raw", REFUSED.values(), ids=REFUSED.keys())
async def test_refused_with_a_clean_400(gateway: Any, raw: bytes) -> None:
    answers, closed = await talk(gateway.url, raw + post())  # a valid request rides behind it
    _refused(answers, closed)
    assert gateway.replica.state.requests == []  # nothing reached a replica, smuggled or not


# ---- answered: correct answers, in order, and the connection stays in step -------------------------


ANSWERED = {
    "plain": post(),
    "chunked": chunked(),
    "chunked, TE in another case": chunked(te=b"transfer-encoding: ChUnKeD\r\n"),
    "chunked in several chunks with extensions": chunked(
        chunks=b"".join(b"%x;ext=1\r\n%s\r\n" % (len(BODY[i : i + 9]), BODY[i : i + 9]) for i in range(0, len(BODY), 9))
        + b"0\r\n\r\n"
    ),
    "chunked with a trailer": chunked(chunks=b"%x\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(BODY), BODY)),
    "absolute-form target": post(target=b"http://evil.example" + PATH.encode()),
    "HTTP/1.0 with keep-alive": post(version=b"1.0", extra=b"Connection: keep-alive\r\n"),
    "Expect: 100-continue": post(extra=b"Expect: 100-continue\r\n"),
}


@pytest.mark.parametrize("raw", ANSWERED.values(), ids=ANSWERED.keys())
async def test_answered_and_still_in_step(gateway: Any, raw: bytes) -> None:
    answers, _ = await talk(gateway.url, raw, post())
    assert len(answers) == 2, answers
    for a in answers:
        _ok(a)
    assert answers[0].headers["x-request-id"] != answers[1].headers["x-request-id"]
    seen = gateway.replica.state.requests
    assert [r["body"] for r in seen] == [BODY, BODY] and all(r["path"] == PATH for r in seen)
    # the gateway chose where to send it: the client's Host and absolute target are not forwarded
    assert all("evil.example" not in r["headers"].get("Host", "") for r in seen)


async def test_pipelined_requests_are_answered_in_order(gateway: Any) -> None:
    n = 6
    reqs = [post(body=BODY.replace(b'"hi"', b'"hi %d"' % i), extra=b"X-Request-Id: pipe-%d\r\n" % i) for i in range(n)]
    answers, _ = await talk(gateway.url, b"".join(reqs))
    assert [a.headers["x-request-id"] for a in answers] == [f"pipe-{i}" for i in range(n)]
    for a in answers:
        _ok(a)
    assert [r["body"] for r in gateway.replica.state.requests] == [
        BODY.replace(b'"hi"', b'"hi %d"' % i) for i in range(n)
    ]


async def test_a_request_split_across_writes_is_one_request(gateway: Any) -> None:
    raw = post()
    answers, _ = await talk(gateway.url, raw[:7], raw[7:40], raw[40:-5], raw[-5:], pause_s=0.05)
    assert len(answers) == 1
    _ok(answers[0])


async def test_absolute_form_to_another_route_is_that_route(gateway: Any) -> None:
    raw = b"GET http://evil.example/health HTTP/1.1\r\nHost: evil.example\r\n\r\n"
    answers, _ = await talk(gateway.url, raw)
    assert len(answers) == 1 and answers[0].status == 200
    assert json.loads(answers[0].body)["status"] == "ok"  # the gateway's own /health, not a proxy hop


@pytest.mark.parametrize("raw", [b"OPTIONS * HTTP/1.1\r\nHost: gw\r\n\r\n", b"CONNECT evil.example:443 HTTP/1.1\r\nHost: gw\r\n\r\n"])
async def test_asterisk_and_authority_forms_are_not_proxied(gateway: Any, raw: bytes) -> None:
    answers, _ = await talk(gateway.url, raw, post())
    assert answers and 400 <= answers[0].status < 500
    assert json.loads(answers[0].body)["error"]["message"]
    assert all(r["path"] == PATH for r in gateway.replica.state.requests)


# ---- slow heads --------------------------------------------------------------------------------------


async def test_a_slowloris_head_is_closed_after_keepalive_s(gateway: Any) -> None:
    """A head trickled a byte at a time never holds a connection past ``downstream.keepalive_s``
    (1 s here): the server closes it without answering, and serves others meanwhile."""
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = post()[:60]
    t0 = time.monotonic()
    closed_at = None
    for byte in head:
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            closed_at = time.monotonic()
            break
        try:
            data = await asyncio.wait_for(reader.read(1), 0.1)
        except TimeoutError:
            continue
        assert data == b""  # no answer to a head that never ended: just the close
        closed_at = time.monotonic()
        break
    writer.close()
    assert closed_at is not None and closed_at - t0 < 1.0 + 2.0, "the trickled head kept its connection"
    # meanwhile and after, others are served
    answers, _ = await talk(gateway.url, post())
    _ok(answers[0])


async def test_a_stalled_body_does_not_reach_a_replica(gateway: Any) -> None:
    raw = post()
    answers, _ = await talk(gateway.url, raw[:-10], idle_s=3.0)  # the body never completes
    assert gateway.replica.state.requests == []
    assert not answers or answers[0].status >= 400


# ---- bodiless answers from a replica --------------------------------------------------------------


@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodiless_answer_is_relayed_without_a_body(gateway_factory: Any, status: int) -> None:
    """A replica's 204/304 reaches the client with no body and no chunked terminator: the client's
    keep-alive connection stays in step (the next answer is the next request's)."""
    from aiohttp import web

    async def inference(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.headers.get("X-Want") == "ok":
            return web.json_response({"object": "chat.completion", "choices": [{"index": 0}]})
        return web.Response(status=status)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post(PATH, inference)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        gw = await gateway_factory([url])
        answers, _ = await talk(gw.url, post(), post(extra=b"X-Want: ok\r\n"))
        assert [a.status for a in answers] == [status, 200]
        assert answers[0].body == b"" and "transfer-encoding" not in answers[0].headers
        assert json.loads(answers[1].body)["object"] == "chat.completion"
    finally:
        await runner.cleanup()

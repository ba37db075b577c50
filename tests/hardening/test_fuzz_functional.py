"""Hypothesis fuzz of the live gateway over a real socket: bodies, headers, session ids, methods, paths.

One gateway (in front of one in-process SGLang emulator) runs on its own event loop in a background
thread; every example is a raw HTTP/1.1 request written to a fresh TCP connection. The property:
the gateway never answers 5xx and never drops the connection without an answer; every 4xx produced
by the gateway's handlers is OpenAI-style JSON (``{"error": {"message", "type", "code"}}``).

Requests aiohttp's HTTP parser itself refuses (malformed request line, header over
``limits.max_field_size``, bad bytes in a header) never reach a middleware; the gateway's runner
answers them with the same JSON error shape (router/gateway/serve.py ``_JsonErrorsRequestHandler``).

The admin API's fuzzing against its OpenAPI spec is tests/router/test_admin_schema.py (schemathesis).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate"]
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass
class Live:
    port: int
    loop: asyncio.AbstractEventLoop


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    """Gateway + emulator on a private loop in a thread (Hypothesis drives sync code)."""
    from replica.emulator.runner import start_emulators, stop_emulators
    from router.clock import SystemClock
    from router.gateway.serve import start_gateway
    from router.store.memory import MemoryStore
    from tests.replica.conftest import small_config
    from tests.router.conftest import fast_config

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def boot() -> None:
        reps = await start_emulators(1, config=small_config())
        cfg = fast_config([reps[0].url], limits={"max_body_bytes": 256 * 1024, "max_session_id_len": 128})
        clock = SystemClock()
        gw = await start_gateway(cfg, MemoryStore(clock, cfg.store.to_store_config()), clock=clock)
        state.update(reps=reps, gw=gw)

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(boot())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, name="fuzz-gateway", daemon=True)
    t.start()
    assert ready.wait(30), "gateway did not start"
    try:
        yield Live(port=state["gw"].port, loop=loop)
    finally:
        async def stop() -> None:
            await state["gw"].close()
            await stop_emulators(state["reps"])

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


def _exchange(port: int, raw: bytes, timeout_s: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(raw)
        # no half-close: the gateway cancels a handler whose client sent EOF (it reads it as a hang-up)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def send(port: int, raw: bytes, timeout_s: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    # aiohttp's parser answers headers over the limits with a 400 and closes at once; when the
    # kernel still holds unread request bytes that close is a reset, which can reach this socket
    # before the 400 is read (a race, gone on the next try). A close without an answer that repeats
    # is the gateway's and fails.
    for attempt in range(3):
        try:
            data = _exchange(port, raw, timeout_s)
            break
        except ConnectionResetError:
            if attempt == 2:
                raise
    assert data, f"connection closed without an answer to {raw[:200]!r}"
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_s, _, rest = rest.partition(b"\r\n")
            size = int(size_s or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    return status, headers, body


SEEN: Counter[int] = Counter()  # statuses over the whole module: the fuzzing reached past the gates


def check(status: int, headers: dict[str, str], body: bytes, raw: bytes) -> None:
    SEEN[status] += 1
    assert status < 500, f"{status} for {raw[:300]!r}: {body[:300]!r}"
    if status >= 400 and "x-kvroute-replica" in headers and "x-kvroute-error" not in headers:
        # the replica's own 4xx, relayed byte for byte (SGLang shapes: {"object":"error","message"...}
        # on OpenAI routes, {"error": "<text>"} from its schema gate)
        obj = json.loads(body)
        assert isinstance(obj.get("message") or obj.get("error"), str | dict), body
    elif status >= 400 and headers.get("content-type", "").startswith("application/json"):
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["type"] and "code" in err, body
    else:
        assert status < 400, (status, headers, body[:300])  # every error is JSON


def request(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    lines += [k + b": " + v for k, v in headers]
    lines += [f"Content-Length: {len(body)}".encode(), b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
chat_like = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=30) | st.integers(),
        "messages": st.lists(st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "x"]) | json_values,
                                                                   "content": st.text(max_size=200) | json_values}),
                             max_size=4) | json_values,
        "prompt": st.text(max_size=200) | json_values,
        "text": st.text(max_size=200) | json_values,
        "input_ids": st.lists(st.integers(), max_size=20) | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-5, 8) | json_values,
        "sampling_params": st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(-2, 8) | json_values}),
        "stream_options": json_values,
    },
)
bodies = (
    chat_like.map(lambda d: json.dumps(d).encode())
    | st.binary(max_size=512)
    | st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass"))
    | json_values.map(lambda v: json.dumps(v).encode())
)
session_ids = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=400),  # over the limit
    st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from(["a" * 128, "a" * 129, "../../etc", "%00", "s p a c e", "\t", "é", "\u202e", ""]),
)


def _header_value(v: str | bytes) -> bytes:
    b = v.encode("utf-8", "surrogatepass") if isinstance(v, str) else v
    return b.replace(b"\r", b"").replace(b"\n", b"")


@FUZZ
@given(route=st.sampled_from(ROUTES), body=bodies, sid=st.none() | session_ids,
       ctype=st.sampled_from([b"application/json", b"text/plain", b"", b"application/json; charset=latin-1"]))  # fmt: skip
def test_fuzzed_bodies_and_session_ids(live: Live, route: str, body: bytes, sid: str | bytes | None, ctype: bytes) -> None:
    headers = [(b"Content-Type", ctype)] if ctype else []
    if sid is not None:
        headers.append((b"Modal-Session-Id", _header_value(sid)))
    raw = request("POST", route, headers, body)
    check(*send(live.port, raw), raw)


header_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=1, max_size=40)


# two or more 20 kB values make Hypothesis warn that the example's repr is large (and the
# "error" warning filter would turn that into a failure): the size is the point of the case
@pytest.mark.filterwarnings("ignore:Generating overly large repr:hypothesis.errors.HypothesisWarning")
@FUZZ
@given(headers=st.lists(st.tuples(header_names.map(str.encode),
                                  st.one_of(st.text(max_size=100).map(_header_value), st.binary(max_size=100).map(_header_value),
                                            st.just(b"x" * 20_000))),
                        max_size=12),
       dup_sid=st.booleans())  # fmt: skip
def test_fuzzed_headers(live: Live, headers: list[tuple[bytes, bytes]], dup_sid: bool) -> None:
    hs = [h for h in headers if h[0].lower() not in (b"content-length", b"transfer-encoding", b"connection", b"host")]
    if dup_sid:
        hs += [(b"Modal-Session-Id", b"one"), (b"Modal-Session-Id", b"two"), (b"x-session-id", b"three")]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    raw = request("POST", "/v1/chat/completions", [(b"Content-Type", b"application/json"), *hs], body)
    check(*send(live.port, raw), raw)


paths = st.one_of(
    st.sampled_from([*ROUTES, "/health", "/ready", "/v1/models", "/v1/models/x", "/admin/replicas", "/metrics", "/",
                     "/v1/chat/completions/", "//v1/chat/completions", "/v1/../v1/models", "/%2e%2e/etc/passwd",
                     "http://evil.example/v1/models", "*", "/v1/responses/resp_1", "/v1/responses/resp_1/cancel",
                     "/v1/responses/resp_%2e%2e%2fflush_cache", "/v1/responses/resp_%2F..%2Fflush_cache/cancel",
                     "/v1/responses/" + "resp_" + "a" * 5000]),
    # stored responses' ids go into the path the gateway builds (router/gateway/stored_responses.py)
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80).map(
        lambda t: "/v1/responses/resp_" + t
    ),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80).map(lambda t: "/" + t),
    st.text(max_size=60).map(lambda t: "/" + t.replace(" ", "%20").replace("\r", "").replace("\n", "")),
)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT", "FOO", "get"])


@FUZZ
@given(method=methods, path=paths, body=st.binary(max_size=64))
def test_fuzzed_methods_and_paths(live: Live, method: str, path: str, body: bytes) -> None:
    raw = request(method, path, [(b"Content-Type", b"application/json")], body)
    try:
        raw.decode("ascii")
    except UnicodeDecodeError:
        pass
    status, headers, got = send(live.port, raw)
    if method == "HEAD":
        assert status < 500
        return
    check(status, headers, got, raw)


def test_gateway_still_serves_after_fuzzing(live: Live) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    raw = request("POST", "/v1/chat/completions", [(b"Content-Type", b"application/json"), (b"Modal-Session-Id", b"after")], body)
    status, _, got = send(live.port, raw)
    assert status == 200, got
    assert json.loads(got)["choices"]
    if sum(SEEN.values()) >= 300:  # the whole module ran: examples were served, refused and routed-around
        assert SEEN[200] > 0 and SEEN[400] > 0 and (SEEN[404] + SEEN[405]) > 0, SEEN


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",  # not HTTP
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad\x01Header: y\r\n\r\n",  # bad bytes in a header name
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",  # header over the limit
    ],
)
def test_requests_the_http_parser_refuses_get_json_errors(live: Live, raw: bytes) -> None:
    status, headers, body = send(live.port, raw)
    assert status == 400 and headers.get("content-type", "").startswith("application/json"), (headers, body)
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "bad_http_request" and err["message"]

"""Security of the live gateway over real sockets (GitHub issue 8, "Security").

- the gateway proxies only to registered replicas: a ``Host`` header or an absolute-URL request target
  (``POST http://evil/...``, sent on a raw socket) never makes it connect anywhere else;
- the admin API needs its bearer token; replica URLs posted to it must be in the allowed networks;
- body, header and session id limits answer clean 4xx;
- the listener serves HTTPS with ``tls_cert``/``tls_key`` (self-signed certificate from ``openssl``),
  also through ``kvroute serve --tls-cert/--tls-key`` as a subprocess;
- Redis AUTH: a gateway with ``--redis redis://:pw@...`` on a ``--requirepass`` redis-server keeps its
  state there (AUTH+TLS of the store itself: tests/router/test_redis_store.py::test_auth_and_tls_urls).

Log redaction of credentials: tests/router/test_gateway_serve.py (access log of a ``kvroute serve``
process) and ``test_credentials_never_reach_log_records`` below (in process, every record formatted).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import shutil
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtests.procs import Procs, free_port, read_line
from loadtests.redis_server import RedisServer, make_self_signed_cert, redis_server_binary
from router.observability.surface import operator_surface_from_config
from tests.router.conftest import fast_config

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()


class CountingServer:
    """A TCP listener that only counts connections and bytes (the 'evil' host)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.connections = 0
        self.data = b""
        self._server: asyncio.Server | None = None

    async def start(self) -> CountingServer:
        async def accept(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                self.data += await asyncio.wait_for(r.read(4096), 1.0)
            except (TimeoutError, ConnectionError):
                pass
            w.close()

        self._server = await asyncio.start_server(accept, self.host, 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _raw(port: int, request: bytes, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection; parse status, headers and the (Content-Length) body."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(request)
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout_s)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        n = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(r.readexactly(n), timeout_s) if n else b""
        return status, headers, body
    finally:
        w.close()


def _is_json_error(body: bytes) -> bool:
    obj = json.loads(body)
    err = obj["error"]
    return isinstance(err["message"], str) and isinstance(err["type"], str) and "code" in err


# ---- never proxy to a host that is not a registered replica ------------------------------------------


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_absolute_url_targets_and_host_header_never_reach_another_host(
    fake_replicas: Any, gateway_factory: Any, method: str
) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url])
    evil = await CountingServer().start()
    try:
        evil_hp = f"127.0.0.1:{evil.port}"
        targets = [f"http://{evil_hp}{CHAT}", f"http://{evil_hp}/v1/models", f"//{evil_hp}{CHAT}",
                   f"http://user:pw@{evil_hp}{CHAT}"]  # fmt: skip
        seen_before = len(rep.state.requests)
        for target in targets:
            body = BODY if method == "POST" else b""
            req = (f"{method} {target} HTTP/1.1\r\nHost: {evil_hp}\r\nModal-Session-Id: abs-1\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                   ).encode() + body  # fmt: skip
            status, headers, got = await _raw(gw.port, req)
            # either served by the registered replica or refused; never relayed elsewhere
            assert status < 500, (target, status, got)
            if status >= 400:
                assert headers["content-type"].startswith("application/json") and _is_json_error(got)
        # and a plain request whose Host names the evil host goes to the registered replica
        hdrs = {"Host": evil_hp, "Modal-Session-Id": "h1", "Content-Type": "application/json"}
        async with aiohttp.ClientSession() as s, s.post(gw.url + CHAT, data=BODY, headers=hdrs) as r:
            assert r.status == 200 and r.headers["X-Kvroute-Replica"] == rep.id
            await r.read()
        await asyncio.sleep(0.2)
        assert evil.connections == 0 and evil.data == b""
        # the replica saw only what the gateway sent it, never the client's Host header value
        for seen in rep.state.requests[seen_before:]:
            assert seen["headers"].get("Host", "") != evil_hp
    finally:
        await evil.close()


# ---- admin API ------------------------------------------------------------------------------------


async def test_admin_requires_token_and_checks_networks(fake_replicas: Any) -> None:
    from router.clock import SystemClock
    from router.gateway.serve import start_gateway
    from router.store.memory import MemoryStore

    (rep,) = await fake_replicas(1)
    cfg = fast_config([rep.url], admin_token="t0ken-123456", admin_networks=["127.0.0.0/8"])
    surface = operator_surface_from_config(cfg)
    clock = SystemClock()
    gw = await start_gateway(cfg, MemoryStore(clock, cfg.store.to_store_config()), clock=clock,
                             extra_setup=(surface.setup,))  # fmt: skip
    try:
        async with aiohttp.ClientSession() as s:
            for hdrs in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "t0ken-123456"},
                         {"Authorization": "Basic dDBrZW4tMTIzNDU2"}):  # fmt: skip
                for method, path in (("GET", "/admin/replicas"), ("POST", "/admin/replicas"),
                                     ("GET", "/admin/config"), ("DELETE", f"/admin/replicas/{rep.id}")):  # fmt: skip
                    async with s.request(method, gw.url + path, headers=hdrs, json={"url": "http://127.0.0.1:1"}) as r:
                        assert r.status == 401, (method, path, hdrs, r.status)
                        assert _is_json_error(await r.read())
            ok = {"Authorization": "Bearer t0ken-123456"}
            async with s.get(gw.url + "/admin/replicas", headers=ok) as r:
                assert r.status == 200
            for url in ("http://8.8.8.8:8000", "http://10.1.2.3:8000", "http://[::1]:8000", "file:///etc/passwd",
                        "http://169.254.169.254/latest", "http://user:pw@127.0.0.1:9"):  # fmt: skip
                async with s.post(gw.url + "/admin/replicas", headers=ok, json={"url": url}) as r:
                    assert r.status == 400, (url, r.status)
                    assert _is_json_error(await r.read())
            assert [x.id for x in await gw.store.replicas()] == [rep.id]
    finally:
        await gw.close()


async def test_registry_replicas_outside_allowed_networks_get_no_traffic(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    from router.model import ReplicaSpec, ReplicaStatus

    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], admin_networks=["127.0.0.1/32"])
    evil = await CountingServer(host="127.0.0.2").start()  # outside 127.0.0.1/32, still loopback
    try:
        # what a sidecar with write access to the registry would do
        spec = ReplicaSpec(id=f"127.0.0.2:{evil.port}", url=f"http://127.0.0.2:{evil.port}",
                           capacity_tokens=400_000)  # fmt: skip
        await gw.store.upsert_replica(spec, ReplicaStatus.ACTIVE)
        async with aiohttp.ClientSession() as s:
            for i in range(20):
                async with s.post(gw.url + CHAT, data=BODY, headers={"Modal-Session-Id": f"r{i}"}) as r:
                    await r.read()
                    assert r.status == 200 and r.headers["X-Kvroute-Replica"] == rep.id  # retried on the allowed one
        await asyncio.sleep(0.3)  # several health rounds: the entry is never probed, and it goes DOWN
        assert evil.connections == 0
        states = {x.id: x.status for x in await gw.store.replicas()}
        assert states[spec.id] is ReplicaStatus.DOWN and states[rep.id] is ReplicaStatus.ACTIVE
        assert gw.runtime.egress is not None and gw.runtime.egress.refused_total > 0
    finally:
        await evil.close()


# ---- limits -------------------------------------------------------------------------------------------


async def test_body_header_and_session_id_limits(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], limits={"max_body_bytes": 64 * 1024, "max_field_size": 2048,
                                                  "max_session_id_len": 64})  # fmt: skip
    async with aiohttp.ClientSession() as s:
        big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 70_000}]}).encode()
        async with s.post(gw.url + CHAT, data=big, headers={"Modal-Session-Id": "b"}) as r:
            assert r.status == 413 and _is_json_error(await r.read())

        async def chunked() -> Any:
            for _ in range(20):
                yield b"x" * 8192

        async with s.post(gw.url + CHAT, data=chunked(), headers={"Modal-Session-Id": "b"}) as r:
            assert r.status == 413 and _is_json_error(await r.read())
        for sid in ("s" * 65, "ünïcode", "a b", "x;y", "\u202e"):
            async with s.post(gw.url + CHAT, data=BODY, headers={"Modal-Session-Id": sid}) as r:
                assert r.status == 400, sid
                assert _is_json_error(await r.read())
        async with s.post(gw.url + CHAT, data=BODY, headers={"Modal-Session-Id": "s" * 64}) as r:
            assert r.status == 200
            await r.read()
    # a header over max_field_size: aiohttp's parser refuses it (400) before any handler runs
    status, _, _ = await _raw(gw.port, (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 4096}\r\n"
                                        "Content-Length: 0\r\nConnection: close\r\n\r\n").encode())  # fmt: skip
    assert status in (400, 431)
    status, _, _ = await _raw(gw.port, b"POST " + b"/" + b"p" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status in (400, 414)
    assert len([q for q in rep.state.requests if q["headers"].get("Modal-Session-Id") == "s" * 64]) <= 1
    assert len(rep.state.requests) == 1  # nothing refused reached the replica


async def test_a_body_session_id_keys_the_session_under_the_same_limits(fake_replicas: Any, gateway_factory: Any) -> None:
    # SGLang's body field ``session_id`` names the session when no header does; it is held to the
    # header's limits (it becomes a store key), and a header wins over it
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], limits={"max_session_id_len": 64})

    def body(sid: Any) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "session_id": sid}).encode()

    async with aiohttp.ClientSession() as s:
        for sid in ("s" * 65, "ünïcode", "a b", "x;y", "\u202e", "\udcff"):
            async with s.post(gw.url + CHAT, data=body(sid)) as r:
                answer = await r.read()
                assert r.status == 400, sid
                assert _is_json_error(answer) and "session_id" in json.loads(answer)["error"]["message"], answer
        assert rep.state.requests == []  # nothing refused reached the replica
        async with s.post(gw.url + CHAT, data=body("b" * 64)) as r:
            assert r.status == 200
            await r.read()
        async with s.post(gw.url + CHAT, data=body("mine"), headers={"Modal-Session-Id": "hdr"}) as r:
            assert r.status == 200
            await r.read()
        async with s.post(gw.url + CHAT, data=body(7)) as r:  # not a string: keyed by the prompt, the replica judges it
            assert r.status == 200
            await r.read()
    assert (await gw.store.snapshot("b" * 64)).session is not None
    assert (await gw.store.snapshot("hdr")).session is not None
    assert (await gw.store.snapshot("mine")).session is None
    # the named session travels on as the routing key header, as a header's does
    assert [q["headers"].get("x-smg-routing-key") for q in rep.state.requests] == ["b" * 64, "hdr", None]


# ---- log redaction ------------------------------------------------------------------------------------


async def test_credentials_never_reach_log_records(fake_replicas: Any, gateway_factory: Any) -> None:
    from router.observability.logging import JsonFormatter

    (rep,) = await fake_replicas(1)
    rep.state.fail_status = 503  # retries and the final error are logged too
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger("kvroute")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        gw = await gateway_factory([rep.url], access_log=True)
        secrets = ("sk-live-SECRET-1", "tok-SECRET-2", "pw-SECRET-3")
        hdrs = {"Authorization": f"Bearer {secrets[0]}", "X-Api-Key": secrets[1], "Modal-Session-Id": "red"}
        async with aiohttp.ClientSession() as s, s.post(gw.url + CHAT + f"?api_key={secrets[2]}", data=BODY,
                                                        headers=hdrs) as r:  # fmt: skip
            assert r.status >= 500  # the replica's 503 after retries
            await r.read()
        await asyncio.sleep(0.1)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    text = stream.getvalue()
    assert text.count("\n") >= 1, "nothing was logged: the test would prove nothing"
    for secret in secrets:
        assert secret not in text
    assert any(h["headers"].get("Authorization") == f"Bearer {secrets[0]}" for h in rep.state.requests)


# ---- TLS on the listener --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.fail("openssl CLI is needed to make a test certificate")
    return make_self_signed_cert(tmp_path_factory.mktemp("tls"))


async def test_tls_listener(fake_replicas: Any, gateway_factory: Any, tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], tls_cert=str(cert), tls_key=str(key))
    assert gw.url.startswith("https://")
    ctx = ssl.create_default_context(cafile=str(cert))
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
        s.post(gw.url + CHAT, data=BODY, headers={"Modal-Session-Id": "tls"}) as r,
    ):
        assert r.status == 200 and r.headers["X-Kvroute-Replica"] == rep.id
        assert (await r.json())["choices"]
    # an untrusting client refuses the self-signed certificate; plain HTTP on the TLS port gets nothing useful
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with s.get(gw.url + "/health"):
                pass
        with pytest.raises(aiohttp.ClientError):
            async with s.get(gw.url.replace("https://", "http://") + "/health") as r:
                await r.read()
                assert r.status == 400  # if it answers at all, it is a TLS-level refusal


def test_tls_config_needs_both_files(tls_files: tuple[Path, Path]) -> None:
    from router.config import load_config
    from router.errors import ConfigError

    cert, key = tls_files
    cfg = load_config(["--tls-cert", str(cert), "--tls-key", str(key)], {})
    assert cfg.tls_cert == str(cert) and cfg.tls_key == str(key)
    with pytest.raises(ConfigError, match="tls_cert"):
        load_config(["--tls-cert", str(cert)], {})
    with pytest.raises(ConfigError, match="tls_key"):
        load_config(["--tls-cert", str(cert), "--tls-key", "/nonexistent/key.pem"], {})


@pytest.fixture
def serve_proc() -> Iterator[Procs]:
    procs = Procs()
    yield procs
    procs.cleanup()


async def _start_serve(procs: Procs, *args: str) -> str:
    p = procs.start([sys.executable, "-m", "router.cli", "serve", "--port", "0", *args], stderr_pipe=True)
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        line = await read_line(p.stderr, 30)
        if "gateway listening on" in line:
            procs.drain(p)
            return line.rsplit(" ", 1)[-1].strip()
        if not line or asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"kvroute serve did not start: {line!r}")


async def test_serve_subprocess_with_tls_flags(
    fake_replicas: Any, tls_files: tuple[Path, Path], serve_proc: Procs
) -> None:
    cert, key = tls_files
    (rep,) = await fake_replicas(1)
    url = await _start_serve(serve_proc, "--replica", rep.url, "--tls-cert", str(cert), "--tls-key", str(key),
                             "--set", "health.health_interval_s=0.1")  # fmt: skip
    assert url.startswith("https://127.0.0.1:")
    ctx = ssl.create_default_context(cafile=str(cert))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        for _ in range(200):
            async with s.post(url + CHAT, data=BODY, headers={"Modal-Session-Id": "tls-p"}) as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert r.status == 200


@pytest.mark.parametrize("tls", [False, True], ids=["auth", "auth+tls"])
async def test_gateway_with_redis_auth(
    fake_replicas: Any, serve_proc: Procs, tls: bool
) -> None:
    if redis_server_binary() is None:
        pytest.fail("redis-server is not installed")
    # TLS only (no plain port at all), with the server's own self-signed certificate
    redis = RedisServer(password="hard3ning-pw", tls=tls)
    await asyncio.to_thread(redis.start)
    try:
        url, port = redis.url, redis.port
        (rep,) = await fake_replicas(1)
        gw_url = await _start_serve(serve_proc, "--replica", rep.url, "--redis", url,
                                    "--set", "health.health_interval_s=0.1")  # fmt: skip
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                async with s.post(gw_url + CHAT, data=BODY, headers={"Modal-Session-Id": "auth-s"}) as r:
                    last = await r.read()
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert r.status == 200, last
        # the binding is in Redis: readable with the password (and over TLS), refused without it
        from router.clock import SystemClock
        from router.store.base import StoreConfig
        from router.store.redis import RedisStore

        store = RedisStore.from_url(url, "reader", StoreConfig(), SystemClock(), op_timeout_s=5.0)
        try:
            sess = await store.session("auth-s")
            assert sess is not None and sess.home == rep.id
        finally:
            await store.close()
        if not tls:
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            w2.write(b"KEYS *\r\n")
            assert (await r2.readline()).startswith(b"-NOAUTH")
            w2.close()
        else:  # a plaintext client gets nothing from the TLS port
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            w2.write(b"AUTH hard3ning-pw\r\nPING\r\n")
            with contextlib.suppress(TimeoutError, ConnectionError):
                assert b"PONG" not in await asyncio.wait_for(r2.read(100), 2.0)
            w2.close()
    finally:
        redis.cleanup()


async def test_gateway_started_while_redis_is_down_still_serves(
    fake_replicas: Any, serve_proc: Procs
) -> None:
    """docs/REDIS.md: an unreachable Redis degrades to local state, also when it is down from the start."""
    (rep,) = await fake_replicas(1)
    dead = free_port()  # nothing listens there
    gw_url = await _start_serve(serve_proc, "--replica", rep.url, "--redis", f"redis://127.0.0.1:{dead}/0",
                                "--set", "health.health_interval_s=0.1")  # fmt: skip
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            async with s.post(gw_url + CHAT, data=BODY, headers={"Modal-Session-Id": "no-redis"}) as r:
                last = await r.read()
                if r.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert r.status == 200, last

"""Start, stop, kill and restart real ``redis-server`` processes for tests (and a local 3-node cluster).

Rules:
  1. Every server listens on 127.0.0.1 on a free port, with persistence off (``--save "" --appendonly no``)
     and its files in a private temporary directory.
  2. ``RedisServer.restart()`` comes back on the *same* port, so clients holding the URL reconnect.
  3. Nothing here is imported by the gateway; the tests (their Redis fixtures) and ``kvroute bench
     faults`` (a Redis it kills and restarts) use it.
"""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from loadtests.procs import free_port

__all__ = [
    "RedisCluster",
    "RedisServer",
    "RedisUnavailable",
    "make_self_signed_cert",
    "redis_server_binary",
]


class RedisUnavailable(RuntimeError):
    """redis-server (or redis-cli for a cluster) is not installed, or it did not come up."""


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _ping(port: int, timeout_s: float = 0.2, tls: bool = False, password: str | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw:
            s: socket.socket = raw
            if tls:
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            s.sendall((f"AUTH {password}\r\nPING\r\n" if password else "PING\r\n").encode())
            data = b""
            while b"PONG" not in data and b"-" not in data:
                chunk = s.recv(256)
                if not chunk:
                    break
                data += chunk
            return b"+PONG" in data
    except OSError:
        return False


def make_self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (cert, key), made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisUnavailable("openssl is not on PATH: cannot make a TLS certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@dataclass
class RedisServer:
    """One redis-server process. ``extra_args`` are appended to the command line."""

    port: int = 0
    extra_args: tuple[str, ...] = ()
    workdir: Path | None = None
    password: str | None = None  # --requirepass
    tls: bool = False  # TLS only (no plain port), self-signed certificate in the workdir
    cert: Path | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _own_dir: bool = field(default=False, repr=False)
    _key: Path | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float = 10.0) -> Self:
        binary = redis_server_binary()
        if binary is None:
            raise RedisUnavailable("redis-server is not on PATH (apt-get install redis-server)")
        if self.port == 0:
            self.port = free_port()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"kvroute-redis-{self.port}-"))
            self._own_dir = True
        cmd = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.tls:
            if self.cert is None:
                self.cert, self._key = make_self_signed_cert(self.workdir)
            i = cmd.index("--port")
            cmd[i + 1] = "0"
            cmd += ["--tls-port", str(self.port), "--tls-cert-file", str(self.cert),
                    "--tls-key-file", str(self._key), "--tls-ca-cert-file", str(self.cert),
                    "--tls-auth-clients", "no"]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = self.workdir / "redis.log"
                err = log.read_text(errors="replace") if log.exists() else ""
                raise RedisUnavailable(f"redis-server exited with {self._proc.returncode}: {err[-500:]}")
            if _ping(self.port, tls=self.tls, password=self.password):
                return self
            time.sleep(0.02)
        self.kill()
        raise RedisUnavailable(f"redis-server did not answer PING on port {self.port} within {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL: the abrupt failure a degradation test wants."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=10)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)

    def restart(self, timeout_s: float = 10.0) -> RedisServer:
        """Bring the server back on the same port (empty: persistence is off)."""
        self.kill()
        return self.start(timeout_s)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


@dataclass
class RedisCluster:
    """A local N-master Redis Cluster (no replicas), created with ``redis-cli --cluster create``."""

    size: int = 3
    nodes: list[RedisServer] = field(default_factory=list)
    _base: Path | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0?cluster=1"

    def start(self, timeout_s: float = 30.0) -> Self:
        cli = shutil.which("redis-cli")
        if cli is None or redis_server_binary() is None:
            raise RedisUnavailable("redis-server / redis-cli not on PATH")
        base = self._base = Path(tempfile.mkdtemp(prefix="kvroute-rcluster-"))
        try:
            for i in range(self.size):
                d = base / str(i)
                d.mkdir()
                node = RedisServer(
                    port=free_port(max_port=55535),
                    workdir=d,
                    extra_args=(
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(d / "nodes.conf"),
                        "--cluster-node-timeout", "15000",  # no test fails a node: a starved CI box must not either
                    ),
                )  # fmt: skip
                self.nodes.append(node.start())
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            res = subprocess.run(
                [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                timeout=timeout_s,
                check=False,
            )
            if res.returncode != 0:
                raise RedisUnavailable(f"redis-cli --cluster create failed: {res.stdout[-500:]!r}")
            # Every node decides cluster_state on its own, after gossip: a client may reach any of
            # them, so wait until all agree (waiting on one node let a CI run meet CLUSTERDOWN).
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if all(self._node_ready(cli, n.port) for n in self.nodes):
                    return self
                time.sleep(0.1)
            raise RedisUnavailable("cluster did not reach cluster_state:ok on every node")
        except BaseException:
            self.cleanup()
            raise

    def _node_ready(self, cli: str, port: int) -> bool:
        info = subprocess.run(
            [cli, "-p", str(port), "cluster", "info"], capture_output=True, timeout=5, check=False
        ).stdout
        return b"cluster_state:ok" in info and f"cluster_known_nodes:{self.size}".encode() in info

    def cleanup(self) -> None:
        for n in self.nodes:
            n.stop()
        self.nodes.clear()
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
            self._base = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

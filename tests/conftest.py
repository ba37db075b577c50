"""Shared fixtures. Redis fixtures start their own ``redis-server`` on a free port (never 6379).

Under CI (``CI=true``) a missing ``redis-server`` is a failure, not a skip; locally those tests skip
with the reason.
"""

from __future__ import annotations

import faulthandler
import os
import socket
from collections.abc import Generator, Iterator

import pytest

from loadtests.redis_server import RedisCluster, RedisServer, RedisUnavailable
from tests.ci import missing

_STDERR = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STDERR] = os.dup(2)  # before output is captured: the watchdog's stack must be seen


def pytest_unconfigure(config: pytest.Config) -> None:
    os.close(config.stash[_STDERR])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """pytest-timeout fails a test by raising from a signal handler, and a test stuck in the event
    loop can swallow that (an asyncio callback catches it, or the stuck test's cleanup hangs too).
    If a test still runs at three times its timeout, print every thread's stack and end the run: CI
    fails then, with the stack, instead of hanging until the job is killed."""
    marker = item.get_closest_marker("timeout")
    given = item.config.getoption("timeout", None)  # pytest-timeout's --timeout, else its ini value
    limit = float(marker.args[0] if marker and marker.args else given or item.config.getini("timeout") or 0)
    if limit > 0:
        faulthandler.dump_traceback_later(3 * limit, exit=True, file=item.config.stash[_STDERR])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _unavailable(reason: str) -> None:
    missing(f"no local Redis: {reason}")


def _flushall(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"FLUSHALL\r\n")
        if not s.recv(64).startswith(b"+OK"):
            raise RuntimeError("FLUSHALL failed")


@pytest.fixture(scope="session")
def redis_server_session() -> Iterator[RedisServer]:
    """One redis-server for the whole test session (do not kill it: use ``redis_killable``)."""
    try:
        server = RedisServer().start()
    except RedisUnavailable as exc:
        _unavailable(str(exc))
        raise  # unreachable: _unavailable skips or fails
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_url(redis_server_session: RedisServer) -> str:
    """URL of a real, empty Redis (the session server, flushed before each test)."""
    if not redis_server_session.running:  # a test broke it: bring it back for the next ones
        redis_server_session.start()
    _flushall(redis_server_session.port)
    return redis_server_session.url


@pytest.fixture
def redis_killable() -> Iterator[RedisServer]:
    """A private redis-server a test may ``kill()`` and ``restart()`` (same port)."""
    try:
        server = RedisServer().start()
    except RedisUnavailable as exc:
        _unavailable(str(exc))
        raise
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_cluster_session() -> Iterator[RedisCluster]:
    """A local 3-master Redis Cluster (a failure under CI if it cannot start, else a skip)."""
    try:
        cluster = RedisCluster(size=3).start()
    except RedisUnavailable as exc:
        missing(f"a local Redis Cluster could not be started: {exc}")
        raise
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def redis_cluster_url(redis_cluster_session: RedisCluster) -> str:
    for node in redis_cluster_session.nodes:
        _flushall(node.port)
    return redis_cluster_session.url

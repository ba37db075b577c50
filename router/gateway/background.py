"""Background Responses (``"background": true``): the engine answers ``queued`` at once and runs the
request afterwards, so the request's load outlives its HTTP exchange. The gateway keeps the request's
lease on that replica until the run ends, so placement counts the work the engine is doing.

Rules:
  1. An unstreamed ``/v1/responses`` answer whose body is a response with ``status`` ``queued`` or
     ``in_progress`` hands its lease to :class:`BackgroundRuns` instead of releasing it.
  2. Every ``health.scrape_interval_s`` (the cadence at which the gateway reads engines anyway) the run
     is read back, ``GET /v1/responses/{id}`` on its replica. A final status releases the lease with
     the final response (its usage is learnt as any response's).
  3. Without anything learnt, the lease is released when the engine no longer knows the response
     (404: it restarted), the replica left the registry, the run outlasts ``timeouts.first_byte_s``
     or the gateway stops. A failed read is tried again until then.
  4. Exactly one release per lease, whatever ends the watch (``finish`` is called once).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import orjson

from router.clock import Clock
from router.config import GatewayConfig
from router.errors import UpstreamError
from router.eventloop import stop_tasks
from router.gateway.bodies import RESPONSE_ID
from router.gateway.forward import ReplicaClient

__all__ = ["RUNNING", "BackgroundRuns", "Gateway", "running_response"]

log = logging.getLogger(__name__)

RUNNING = frozenset({"queued", "in_progress"})
_VALID_ID = re.compile(RESPONSE_ID)

# the final response (None: released without it, rule 3) -> the lease released
Finish = Callable[[Mapping[str, Any] | None], Awaitable[None]]


def running_response(doc: Any) -> str | None:
    """Rule 1: the id of a response the engine is still running, from an answer's parsed body."""
    if not isinstance(doc, dict) or doc.get("object") != "response" or doc.get("status") not in RUNNING:
        return None
    rid = doc.get("id")
    return rid if isinstance(rid, str) and _VALID_ID.fullmatch(rid) else None  # it goes into a URL


class Gateway(Protocol):
    """What a watch reads of the gateway (``runtime.GatewayRuntime``)."""

    config: GatewayConfig
    clock: Clock
    client: ReplicaClient | None

    async def replica_url(self, replica_id: str) -> str | None: ...


class BackgroundRuns:
    """The leases of background responses still running on their engines, one watch task each."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    async def hold(self, rt: Gateway, replica_id: str, response_id: str, finish: Finish) -> None:
        """Rule 1: watch ``response_id`` on ``replica_id``; ``finish`` releases the lease (at once if
        the gateway is stopping)."""
        if self._closed:
            await finish(None)
            return
        task = asyncio.create_task(_watch(rt, replica_id, response_id, finish), name=f"kvroute-bg-{response_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Rule 3: the gateway stops; every held lease is released."""
        self._closed = True
        await stop_tasks(*self._tasks)


async def _watch(rt: Gateway, replica_id: str, response_id: str, finish: Finish) -> None:
    final: Mapping[str, Any] | None = None
    deadline = rt.clock.now() + rt.config.timeouts.first_byte_s
    try:
        final = await _final(rt, replica_id, response_id, deadline)
    finally:  # also when the gateway stops (cancelled): released, nothing learnt
        await asyncio.shield(finish(final))  # rule 4


async def _final(rt: Gateway, replica_id: str, response_id: str, deadline: float) -> Mapping[str, Any] | None:
    interval = rt.config.health.scrape_interval_s
    while rt.clock.now() < deadline:
        await asyncio.sleep(interval)
        try:
            url = await rt.replica_url(replica_id)
        except UpstreamError:
            return None  # its URL is no longer allowed: nothing more is sent there
        if url is None or rt.client is None:
            return None  # the replica left: its load left with it
        try:
            status, body = await rt.client.fetch(replica_id, f"{url}/v1/responses/{response_id}")
        except UpstreamError as exc:
            log.debug("background response %s on %s: read failed: %s", response_id, replica_id, exc)
            continue
        if status == 404:
            return None  # the engine restarted and lost it
        if status != 200:
            continue
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict) and doc.get("status") not in RUNNING:
            return doc
    log.warning("background response %s on %s still running after %.0f s: its load is released",
                response_id, replica_id, rt.config.timeouts.first_byte_s)  # fmt: skip
    return None

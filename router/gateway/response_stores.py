"""Which replicas keep OpenAI Responses API responses (SGLang ``--enable-response-store``): the
gateway pins stored responses only there (``stored_responses.py``, rule 1)."""

from __future__ import annotations

import json

from router.errors import UpstreamError
from router.gateway.forward import ReplicaClient
from router.model import ReplicaId

__all__ = ["StoreSupport"]


class StoreSupport:
    """Which replicas keep responses: their ``/server_info``'s ``enable_response_store``, read after a
    response (never on a client's latency path), at most once per replica per ``max_age_s``. A
    replica not yet known counts as keeping: a pin too many costs ~0.3 kB of gateway memory (and
    ~0.14 kB of Redis) for a session TTL, a pin too few a 404. In front of engines without a store
    (SGLang's default) this keeps every Responses request from writing a pin."""

    __slots__ = ("_asking", "_known", "max_age_s")

    def __init__(self, max_age_s: float = 600.0) -> None:
        self.max_age_s = max_age_s
        self._known: dict[ReplicaId, tuple[bool, float]] = {}  # -> (keeps responses, read at)
        self._asking: set[ReplicaId] = set()

    def keeps(self, replica_id: ReplicaId, now: float) -> bool | None:
        """``None``: not known, or known longer ago than ``max_age_s`` (an engine may restart with
        other flags)."""
        known = self._known.get(replica_id)
        if known is None or now - known[1] > self.max_age_s:
            return None
        return known[0]

    async def learn(self, client: ReplicaClient, replica_id: ReplicaId, url: str, now: float) -> None:
        """Read one replica's ``/server_info`` (one reader at a time per replica); a replica that does
        not answer, or answers something else, stays unknown."""
        if replica_id in self._asking:
            return
        self._asking.add(replica_id)
        try:
            status, body = await client.fetch(replica_id, url + "/server_info", accept="application/json")
            flag = json.loads(body).get("enable_response_store") if status == 200 else None
        except (UpstreamError, ValueError, AttributeError):
            flag = None
        finally:
            self._asking.discard(replica_id)
        if isinstance(flag, bool):
            self._known[replica_id] = (flag, now)

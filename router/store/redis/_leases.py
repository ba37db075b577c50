"""This gateway's own outstanding leases: the exact in-flight counts Redis is restored to.

Rules:
  1. A lease is added once ``acquire`` landed in Redis and removed exactly once by ``release``; an
     unknown or already released lease is ignored (load never goes negative).
  2. ``per_replica`` and ``per_session`` always equal what the outstanding leases add up to: the
     fast path composes them into its view, and a restore writes them to Redis verbatim.
  3. ``suspects``: sessions whose acquire may or may not have landed (the call failed); a restore
     resets their fields for this gateway too.
"""

from __future__ import annotations

from router.model import Lease, ReplicaId

__all__ = ["OwnLeases"]


class OwnLeases:
    def __init__(self, gateway_id: str) -> None:
        self._gateway_id = gateway_id
        self._seq = 0
        self._leases: dict[str, Lease] = {}
        self.per_replica: dict[ReplicaId, int] = {}
        self.per_session: dict[str, dict[ReplicaId, int]] = {}
        self.suspects: set[str] = set()

    def __len__(self) -> int:
        return len(self._leases)

    def next_id(self) -> str:
        self._seq += 1
        return f"{self._gateway_id}/{self._seq}"

    def add(self, lease: Lease) -> None:
        self._leases[lease.lease_id] = lease
        self._count(lease, 1)

    def pop(self, lease: Lease) -> bool:
        """Forget ``lease``; False if it was not outstanding (rule 1)."""
        if self._leases.pop(lease.lease_id, None) is None:
            return False
        self._count(lease, -1)
        return True

    def _count(self, lease: Lease, k: int) -> None:
        rid = lease.replica_id
        n = self.per_replica.get(rid, 0) + k
        if n > 0:
            self.per_replica[rid] = n
        else:
            self.per_replica.pop(rid, None)
        if lease.session_id is not None:
            d = self.per_session.setdefault(lease.session_id, {})
            m = d.get(rid, 0) + k
            if m > 0:
                d[rid] = m
            else:
                d.pop(rid, None)
            if not d:
                del self.per_session[lease.session_id]

    def restore_args(self) -> list[str | int | float]:
        """The ``lease restore`` script's arguments after the lease TTL: our exact counts per replica,
        then per session (suspects with none: their fields are cleared)."""
        args: list[str | int | float] = [len(self.per_replica)]
        for rid, n in self.per_replica.items():
            args += [rid, n]
        sessions = dict(self.per_session)
        for sid in self.suspects:
            sessions.setdefault(sid, {})
        args.append(len(sessions))
        for sid, d in sessions.items():
            args += [sid, len(d)]
            for rid, n in d.items():
                args += [rid, n]
        return args

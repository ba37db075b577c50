"""The prefill work ahead on each replica, as one gateway knows it (rule 8, docs/POLICY.md).

A request's prefill starts only after the uncached prompts queued ahead of it on its replica. The
gateway knows the requests it sent itself: each is entered when sent, with the prompt tokens the
policy expects it to compute there (``expected_uncached``), and leaves at its first token, when
its prefill is done (or when it ends without one). The sum per replica is the
policy's ``ClusterSnapshot.prefill_ahead``.

Pure bookkeeping (no I/O, no clock): the gateway and the simulator keep one per gateway and fill the
snapshot the same way. Another gateway's requests are not in it: with several gateways the snapshot
takes, per replica, the larger of the ledger and the engine's own report of its queue
(``with_ahead(others=True)``, then :func:`work_ahead`; measured in docs/POLICY.md round 40).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from router.model import ClusterSnapshot, ReplicaId, ReplicaState, RouteRequest

__all__ = ["PrefillLedger", "expected_uncached", "work_ahead"]


def expected_uncached(request: RouteRequest, snapshot: ClusterSnapshot, replica_id: ReplicaId) -> int:
    """The prompt tokens a request is expected to compute on ``replica_id`` (its prefill work
    there): its estimated prompt less what of its session is cached there. At the session's home,
    its whole context (a turn goes home while its cache is there, else it is placed afresh);
    elsewhere, what the engine's KV events show resident there. Rule 8 weighs replicas by it; the
    gateway enters it in its ``PrefillLedger``."""
    prompt = max(0, request.prompt_tokens_estimate)
    sess = snapshot.session
    if sess is None or sess.session_id != request.session_key:
        return prompt
    if replica_id == sess.home:
        # not ``resident_tokens``: those leave out the prefix the session shares with others, which
        # is cached there too (counting it as work ahead spilled warm turns: POLICY.md round 38)
        cached = sess.context_tokens
    else:
        cached = next((t for r, t in sess.resident_on if r == replica_id), 0)
    return prompt - min(prompt, max(0, cached))


def work_ahead(snapshot: ClusterSnapshot, replica: ReplicaState) -> int:
    """The prefill work ahead of a new request on ``replica`` (a replica of ``snapshot``): this
    gateway's ledger entry, and with other gateways (``engines_ahead``) at least the engine's own
    report of its queue."""
    own = snapshot.prefill_ahead.get(replica.id, 0)
    return max(own, replica.engine.waiting_uncached_tokens) if snapshot.engines_ahead else own


class PrefillLedger:
    __slots__ = ("_ahead", "_entries", "_view")

    def __init__(self) -> None:
        self._entries: dict[str, tuple[ReplicaId, int]] = {}  # lease id -> (replica, uncached tokens)
        self._ahead: dict[ReplicaId, int] = {}
        self._view: Mapping[ReplicaId, int] | None = None  # made on first read after a change

    def sent(self, lease_id: str, replica_id: ReplicaId, uncached_tokens: int) -> None:
        """A request was sent to ``replica_id`` expecting to compute ``uncached_tokens`` there."""
        if uncached_tokens <= 0 or lease_id in self._entries:
            return
        self._entries[lease_id] = (replica_id, uncached_tokens)
        self._ahead[replica_id] = self._ahead.get(replica_id, 0) + uncached_tokens
        self._view = None

    def prefilled(self, lease_id: str) -> None:
        """The request's first token came, or it ended: its prefill is no longer ahead of anyone.
        Idempotent."""
        entry = self._entries.pop(lease_id, None)
        if entry is None:
            return
        rid, tokens = entry
        left = self._ahead[rid] - tokens
        if left > 0:
            self._ahead[rid] = left
        else:
            del self._ahead[rid]
        self._view = None

    def with_ahead(self, snapshot: ClusterSnapshot, *, others: bool = False) -> ClusterSnapshot:
        """``snapshot`` with ``prefill_ahead`` (the one way both drivers fill it). ``others``: other
        gateways send to this fleet too. Their requests are not in this ledger; each engine's own
        report of its queued uncached prefill (``EngineLoad.waiting_uncached_tokens``, a scrape
        old, SGLang's estimate) holds them, so a replica's work ahead is the larger of the two
        (``engines_ahead``, read by :func:`work_ahead` for the replicas rule 8 looks at: merging
        here would walk the whole fleet on every request). Alone, the ledger is exact and fresher,
        and the engine's figure would only add its noise."""
        ahead = self.ahead()
        if not ahead and not others:
            return snapshot
        return dataclasses.replace(snapshot, prefill_ahead=ahead, engines_ahead=others)

    def ahead(self) -> Mapping[ReplicaId, int]:
        """``ClusterSnapshot.prefill_ahead``: the tokens ahead on every replica with some. A read-only
        copy, made once per change: a snapshot that holds it never sees the ledger move on."""
        if self._view is None:
            self._view = MappingProxyType(dict(self._ahead))
        return self._view

    def __len__(self) -> int:
        return len(self._entries)

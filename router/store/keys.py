"""The Redis key scheme. PURE (no I/O); the Lua scripts in ``lua/`` build the same names.

Rule 1: every key of one fleet starts with the hash tag ``{<prefix>}``, so all of them live in ONE
        Redis Cluster hash slot and every Lua script may touch any of them atomically. The price:
        one cluster node holds (and serves) the whole routing state of a fleet. At gateway scale
        (thousands of requests/s, tens of replicas) that is far below one Redis core's capacity.
Rule 2: ids (session, replica, gateway) are used verbatim after the last ``:`` of the name; they
        may contain any byte except that a gateway id must not contain ``|`` (session in-flight
        fields are ``f:<gateway>|<replica>``).

Keys (``P`` = ``{prefix}:``):

    P seq                  string  monotone request counter (snapshot.seq)
    P replicas             set     registered replica ids
    P r:<rid>              hash    spec (JSON), status, joined (fleet s), engine (JSON), tw (tokens
                                   written), actctx (sum of active sessions' context), exp (fleet s;
                                   0 = no TTL, registry entries written by sidecars only)
    P act:<rid>            zset    sessions homed on rid, score = last_seen (fleet s), pruned by the
                                   active window
    P actx:<rid>           hash    sid -> context tokens counted in ``actctx``
    P plc:<rid>            zset    placements (member = seq), score = time, pruned by the ramp window
    P home:<rid>           zset    sessions whose home is rid, score = last_seen (admin / drain view)
    P s:<sid>              hash    home, ovf (comma list), ctx, seen, mark, turns,
                                   f:<gid>|<rid> -> in-flight count of that gateway on that replica;
                                   PEXPIRE = session idle TTL (refreshed on every touch)
    P health               hash    rid -> "<fleet s>|<fresh s>|<writer>": the last good health check someone shared
                                   (discovery rule 7); dropped with the replica
    P gw                   zset    gateway id -> lease expiry (Redis server ms, from TIME)
    P gw:<gid>:if          hash    replica -> in-flight count of that gateway (ignored once its
                                   lease has expired; deleted by the next live gateway's heartbeat)
    P es:<esid>            string  "<replica>|<last use, fleet s>": the replica an SGLang engine session
                                   (``/open_session``) lives on (``PinKind``); PEXPIRE = session idle TTL
                                   (refreshed on every read)
    P resp:<id>            string  the same for a Responses API response the engine stored
    P config               hash    gen (counter), doc (JSON {"policy", "params"}): the policy config
                                   shared by ``PATCH /admin/config``, which every gateway follows

Exact residency shared by KV-event writers (one per replica: its sidecar, or a gateway; see
``router/store/residency.py`` and docs/KV_EVENTS.md):

    P res:<rid>            hash    session -> tokens of it resident on rid (known values only)
    P ress                 hash    rid -> "<source>|<expiry, Redis ms>|<writer>" (events / estimate)
    P resx                 stream  every change: n (counter), r (replica), k (d = delta, r = reset
                                   first), s (source), t (ttl ms), d (JSON [[session, tokens|null]...]);
                                   capped (MAXLEN ~), readers resync on a gap in n
    P resn                 string  the counter of resx entries
"""

from __future__ import annotations

from dataclasses import dataclass

from router.model import PinKind

__all__ = ["KeySpace", "session_field"]


def session_field(gateway_id: str, replica_id: str) -> str:
    """The session hash field holding one gateway's in-flight count on one replica."""
    return f"f:{gateway_id}|{replica_id}"


@dataclass(frozen=True, slots=True)
class KeySpace:
    prefix: str = "kvroute"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{}"):
            raise ValueError(f"key prefix must be non-empty and free of braces: {self.prefix!r}")

    @property
    def base(self) -> str:
        """``{prefix}:``: what every key starts with (passed to the Lua scripts as ARGV[1])."""
        return "{" + self.prefix + "}:"

    @property
    def seq(self) -> str:
        return self.base + "seq"

    @property
    def replicas(self) -> str:
        return self.base + "replicas"

    @property
    def gateways(self) -> str:
        return self.base + "gw"

    def replica(self, rid: str) -> str:
        return f"{self.base}r:{rid}"

    def active(self, rid: str) -> str:
        return f"{self.base}act:{rid}"

    def active_ctx(self, rid: str) -> str:
        return f"{self.base}actx:{rid}"

    def placements(self, rid: str) -> str:
        return f"{self.base}plc:{rid}"

    def home_index(self, rid: str) -> str:
        return f"{self.base}home:{rid}"

    def session(self, sid: str) -> str:
        return f"{self.base}s:{sid}"

    def gateway_inflight(self, gid: str) -> str:
        return f"{self.base}gw:{gid}:if"

    def pin(self, kind: PinKind, name: str) -> str:
        return f"{self.base}{kind.value}:{name}"

    def residency(self, rid: str) -> str:
        return f"{self.base}res:{rid}"

    @property
    def residency_sources(self) -> str:
        return self.base + "ress"

    @property
    def residency_stream(self) -> str:
        return self.base + "resx"

    @property
    def residency_counter(self) -> str:
        return self.base + "resn"

    def slot_tag(self) -> str:
        """The hash tag Redis Cluster hashes for every key above."""
        return self.prefix

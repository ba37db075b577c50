"""Membership and health: background loops that poll every registered replica.

Rules:
  1. The replica list is read from the store on every round, so replicas registered later (admin
     API, sidecars through Redis, ``upsert_replica`` in tests) are picked up without a restart.
  2. State machine (pure, :func:`health_transition`): JOINING -> ACTIVE on the first good health
     check; ACTIVE -> DOWN after ``unhealthy_threshold`` consecutive failures; DOWN -> ACTIVE after
     ``healthy_threshold`` consecutive successes. DRAINING belongs to the operator: health never
     changes it. When every replica is DOWN the gateway still tries them (panic routing,
     ``router/gateway/handlers.py``) rather than refusing clients.
  3. A busy engine is not a dead one. A probe has three outcomes (:class:`ProbeOutcome`): OK, FAILED
     (an answer other than 200, or a refused/reset connection: the engine says it is unwell, or is
     not there) and TIMEOUT (no answer in time). A real SGLang serving a deep queue answers
     ``/health`` late (it runs a request through the scheduler), so a TIMEOUT alone is *busy*: it
     counts towards ejection only with more evidence (the replica is *suspect*): requests the
     gateway sent it failed (timeouts, 5xx, broken streams) since its last success, or it has shown
     no sign of life (no good probe, no request answered) for ``stall_after_s``. A wedged engine
     therefore goes DOWN after ``stall_after_s`` plus ``unhealthy_threshold`` probe periods; a busy
     one that keeps answering requests stays ACTIVE and keeps its sessions' affinity.
  3b. Passive ejection: the forwarder reports connect errors; ``eject_on_connect_errors`` of them in
     a row take an ACTIVE replica DOWN at once (readmitted by health checks like any DOWN replica).
  4. Polling is cheap: one shared client session, per-probe timeouts, jittered intervals, one
     probe per replica at a time. The load is read from ``/v1/loads?include=core`` (small JSON,
     every figure but the HiCache host tier's); ``/metrics`` (``Accept: text/plain``), whose whole
     exposition costs far more to parse, is read for the host tier every ``METRICS_EVERY`` rounds,
     and every round for an engine without a usable ``/v1/loads`` (an older SGLang, another
     engine). SGLang 0.5.23 has no ``/get_load`` (404), so it is never asked.
  5. Polling is smooth: a round starts every interval (not an interval after the last one ended)
     and starts its replicas' probes evenly over ``spread`` of it, in the store's order, so each
     replica keeps its phase and the answers do not reach the event loop together: each answer
     costs loop time (a parsed ``/metrics`` the most), and many replicas answering at once would
     stall every request the gateway is relaying (``kvroute bench probes`` measures it).
  6. One scrape per replica per interval, fleet-wide. A replica whose figures in the store are
     someone else's (its sidecar's, another gateway's on the same Redis: the figures name the
     discovery that scraped them, ``EngineLoad.reported_by``) is not scraped while they are younger
     than two intervals (stretched by the jitter; the round reads the store once, up to ``spread``
     of an interval before its last probe): the writer keeps scraping, everyone else reads its
     figures. Many gateways in front of many replicas otherwise each spend a large part of a core
     parsing every replica's ``/metrics`` every second (docs/BENCHMARKS.md, "Scrapes shared through
     the store"), and each engine answers every gateway. When the writer stops, its figures age out
     within about two intervals and the next round scrapes them again. Stamps are epoch seconds of
     the writer's host: figures from a host whose clock is behind by more than that are scraped
     anyway (as without the rule); one whose clock is ahead keeps a dead writer's figures fresh by
     its lead.
  7. One health check per replica per interval, fleet-wide, while all is well. Each round's good
     checks are shared through the store at its end (``report_health``: when, this discovery's
     writer id, and how long it vouches for them: (2 + spread) x interval x (1 + jitter), within
     which its next round lands; a sidecar shares its checks of its engine the same way, for its
     own interval). A round leaves an ACTIVE or DRAINING replica alone while someone else's shared
     check of it is that fresh and this gateway has no evidence of its own against it: no failed
     request or refused connection since its last success, no failed or timed-out check of its own
     since its last good one. The shared check counts as a sign of life (rule 3). JOINING and DOWN
     replicas are always checked (their transitions rest on this gateway's own streaks). When the
     writer sees a failure it shares nothing, the check ages out and every gateway checks for
     itself again, as without the rule: a replica goes DOWN after ``unhealthy_threshold`` failed
     checks of whichever gateway sees them first. On SGLang a ``/health`` is a one-token generate
     through the scheduler, so without this rule an engine behind G gateways ran G of them a second
     (docs/BENCHMARKS.md, "Health checks shared through the store").
  8. The probing is divided among the gateways. The store lists the live gateways (``probers``:
     their Redis lease holders); each replica is the probing of one of them, its rendezvous pick
     (``hrw_top``, the same in every process). That gateway scrapes and checks it even while another
     gateway's figures or check are fresh (it takes the replica over), and any other gateway leaves
     it alone while its figures or check are fresh, its own included: G gateways probe about N / G
     replicas each, instead of the first writer keeping them all. (Deferring to fresh figures of
     its own matters: checks are shared at the end of a round, so a gateway whose rounds end after
     the pick's would otherwise overwrite the pick's checks every round and both would go on
     checking.) A sidecar's figures and checks are never taken over. A gateway not in the list (the
     memory store, a lost lease) takes nothing over and defers to nobody; a pick that does not
     probe (its discovery off, or dead before its lease expires) leaves its replicas to the others
     whenever their figures and checks have aged out: probed every two or three intervals instead
     of every one, until its lease expires and the picks change.
  9. A replica that is one data-parallel rank of its engine (``dp_rank``) is kept out of service
     while its engine's ``/v1/loads`` lists its ranks without that one (a wrong
     ``--replica-dp-ranks`` or sidecar ``--dp-rank``: the engine would refuse every request named to
     it): its health checks fail, with a warning, and it has no figures; scraped even while DOWN, it
     comes back when the rank does. A JOINING rank becomes ACTIVE only once its rank's figures have
     been read (by anyone), so no request reaches it before the rank is known to exist.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import random
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from router.clock import Clock
from router.config import HealthConfig
from router.engine_metrics import (
    LoadReadings,
    MetricsParseError,
    listed_dp_ranks,
    load_from_v1_loads,
    parse_engine_metrics,
    v1_loads_query,
)
from router.errors import ReplicaNotFoundError, UpstreamError, UpstreamTimeoutError
from router.events import Event, ReplicaActivated, ReplicaEjected, ReplicaReadmitted
from router.model import EngineLoad, HealthStamp, ReplicaId, ReplicaState, ReplicaStatus
from router.policy.hashing import hrw_top
from router.store.base import StateStore

if TYPE_CHECKING:
    from router.gateway.egress import EgressGuard
    from router.gateway.forward import ReplicaClient

__all__ = ["Discovery", "HealthTrack", "ProbeOutcome", "health_transition"]

log = logging.getLogger("kvroute.discovery")

_METRICS_OFF_BACKOFF = 30  # rounds to skip after a 404 on /metrics (engine without --enable-metrics)


class ProbeOutcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"  # answered other than 200, or the connection was refused/reset
    TIMEOUT = "timeout"  # no answer in time: busy or wedged, ambiguous on its own (rule 3)


@dataclass(frozen=True, slots=True)
class HealthTrack:
    ok_streak: int = 0
    fail_streak: int = 0
    busy_streak: int = 0  # timeouts in a row that were not counted as failures


def health_transition(
    status: ReplicaStatus,
    track: HealthTrack,
    outcome: ProbeOutcome | bool,
    cfg: HealthConfig,
    *,
    suspect: bool = True,
) -> tuple[HealthTrack, ReplicaStatus | None]:
    """PURE. The new track and the new status (``None`` = unchanged) after one health check.

    ``outcome``: ``True``/``False`` mean OK/FAILED. ``suspect``: the replica has failed requests
    since its last success or shown no sign of life for ``stall_after_s`` (rule 3); without it a
    TIMEOUT leaves the failure streak as it was (and breaks a success streak).
    """
    if isinstance(outcome, bool):
        outcome = ProbeOutcome.OK if outcome else ProbeOutcome.FAILED
    if outcome is ProbeOutcome.OK:
        track = HealthTrack(ok_streak=track.ok_streak + 1, fail_streak=0)
        if status is ReplicaStatus.JOINING:
            return track, ReplicaStatus.ACTIVE
        if status is ReplicaStatus.DOWN and track.ok_streak >= cfg.healthy_threshold:
            return track, ReplicaStatus.ACTIVE
        return track, None
    if outcome is ProbeOutcome.TIMEOUT and not suspect:
        return HealthTrack(ok_streak=0, fail_streak=track.fail_streak, busy_streak=track.busy_streak + 1), None
    track = HealthTrack(ok_streak=0, fail_streak=track.fail_streak + 1)
    if status is ReplicaStatus.ACTIVE and track.fail_streak >= cfg.unhealthy_threshold:
        return track, ReplicaStatus.DOWN
    return track, None


async def _staggered(
    replicas: Sequence[ReplicaState], spread_s: float, probe: Callable[[ReplicaState], Awaitable[None]]
) -> None:
    """``probe`` every replica, the i-th of n starting i/n of ``spread_s`` after the first."""
    step = spread_s / len(replicas) if replicas else 0.0

    async def probe_at(i: int, r: ReplicaState) -> None:
        if i and step > 0:
            await asyncio.sleep(i * step)
        await probe(r)

    await asyncio.gather(*(probe_at(i, r) for i, r in enumerate(replicas)))


class Discovery:
    def __init__(
        self,
        store: StateStore,
        client: ReplicaClient,
        cfg: HealthConfig,
        *,
        clock: Clock,
        emit: Callable[[Event], None],
        rng: random.Random,
        probe_timeout_s: float = 2.0,
        egress: EgressGuard | None = None,
        writer_id: str | None = None,
    ) -> None:
        self._store = store
        # who this discovery is in the shared figures and checks (rules 6-8): the gateway's id in the
        # store's list of live gateways (its Redis lease holder, unique per process) or a unique one
        self.writer_id = writer_id or f"discovery~{secrets.token_hex(4)}"
        self._client = client
        self._egress = egress
        self._cfg = cfg
        self._clock = clock
        self._emit = emit
        self._rng = rng
        self._probe_s = probe_timeout_s
        self._tracks: dict[ReplicaId, HealthTrack] = {}
        self._connect_errors: dict[ReplicaId, int] = {}
        self._metrics_off: dict[ReplicaId, int] = {}
        self._loads_off: dict[ReplicaId, int] = {}
        # rule 9: rank replicas whose engine's /v1/loads lists its ranks without theirs -> why
        self._rankless: dict[ReplicaId, str] = {}
        self._readings: dict[ReplicaId, LoadReadings] = {}  # when /metrics is due, the host tier (rule 4)
        self._request_failures: dict[ReplicaId, int] = {}  # since the replica's last success
        self._alive_at: dict[ReplicaId, float] = {}  # last sign of life: good probe or answered request
        # rule 8: (probers, replica ids) the designation was computed for, and the replicas it gives us
        self._designation: tuple[frozenset[str], frozenset[ReplicaId]] = (frozenset(), frozenset())
        self._mine: frozenset[ReplicaId] = frozenset()
        self._lock = asyncio.Lock()  # status changes: health loop vs passive ejection
        self.scrapes_ok = 0
        self.scrapes_failed = 0
        self.scrapes_shared = 0  # skipped: someone else's figures were fresh (rule 6)
        self.health_ok = 0
        self.health_failures = 0
        self.health_busy = 0  # probe timeouts tolerated as "busy" (rule 3)
        self.health_shared = 0  # skipped: someone else's good check was fresh (rule 7)

    # ---- passive signals from the forwarder ------------------------------------------------------

    async def on_connect_error(self, replica_id: ReplicaId, detail: str = "") -> None:
        n = self._connect_errors.get(replica_id, 0) + 1
        self._connect_errors[replica_id] = n
        limit = self._cfg.eject_on_connect_errors
        if limit == 0 or n < limit:
            return
        async with self._lock:
            state = await self._state(replica_id)
            if state is None or state.status is not ReplicaStatus.ACTIVE:
                return
            if await self._set_status(replica_id, ReplicaStatus.DOWN):
                self._tracks[replica_id] = HealthTrack()
                self._connect_errors[replica_id] = 0
                log.warning("replica %s ejected after %d connect error(s): %s", replica_id, n, detail)
                self._emit(
                    ReplicaEjected(
                        at=self._clock.now(), replica_id=replica_id, cause="connect", detail=detail
                    )
                )

    def on_success(self, replica_id: ReplicaId) -> None:
        """The replica answered a request (response headers arrived): a sign of life."""
        if self._connect_errors.get(replica_id):
            self._connect_errors[replica_id] = 0
        if self._request_failures.get(replica_id):
            self._request_failures[replica_id] = 0
        self._alive_at[replica_id] = self._clock.now()

    def on_request_failure(self, replica_id: ReplicaId, detail: str = "") -> None:
        """A request to the replica failed other than by a refused connection (timed out, 5xx,
        stream broken): evidence that makes its probe timeouts count (rule 3)."""
        self._request_failures[replica_id] = self._request_failures.get(replica_id, 0) + 1
        log.debug("request to %s failed: %s", replica_id, detail)

    def suspect(self, replica_id: ReplicaId) -> bool:
        """Requests failed since its last success, or no sign of life for ``stall_after_s``."""
        if self._request_failures.get(replica_id, 0) > 0:
            return True
        now = self._clock.now()
        alive = self._alive_at.setdefault(replica_id, now)
        return now - alive >= self._cfg.stall_after_s

    # ---- one round ---------------------------------------------------------------------------------

    async def check_health_once(self, spread_s: float = 0.0) -> None:
        """Check every replica, spread over ``spread_s`` (rule 5; 0 at start-up)."""
        replicas = await self._store.replicas()
        self._forget_missing(replicas)
        shared = await self._store.health_stamps()
        probers = await self._probers(replicas)
        cfg = self._cfg
        fresh_s = (2.0 + cfg.spread) * cfg.health_interval_s * (1.0 + cfg.jitter)  # our next round lands within
        good: dict[ReplicaId, HealthStamp] = {}

        async def check(r: ReplicaState) -> None:
            if (self._egress is None or await self._egress.allowed(r.url)) and self._checked_by_another(
                r, shared.get(r.id), probers
            ):
                self.health_shared += 1
                return
            if await self._check_one(r):
                good[r.id] = HealthStamp(at=self._clock.now(), by=self.writer_id, fresh_s=fresh_s)

        await _staggered(replicas, spread_s, check)
        if good:
            await self._store.report_health(good)

    def _checked_by_another(self, r: ReplicaState, stamp: HealthStamp | None, probers: frozenset[str]) -> bool:
        """Rule 7: someone else's good check of ``r`` is fresh and nothing here speaks against it (and,
        rule 8, it is not ours to check in another gateway's stead)."""
        if stamp is None or not self._leaves_to_another(r, stamp.by, probers):
            return False
        if r.status not in (ReplicaStatus.ACTIVE, ReplicaStatus.DRAINING):
            return False
        if self._request_failures.get(r.id, 0) or self._connect_errors.get(r.id, 0):
            return False
        track = self._tracks.get(r.id)
        if track is not None and (track.fail_streak or track.busy_streak):
            return False
        if self._clock.now() - stamp.at >= stamp.fresh_s:
            return False
        self._alive_at[r.id] = max(self._alive_at.get(r.id, 0.0), stamp.at)
        return True

    async def scrape_once(self, spread_s: float = 0.0) -> None:
        """Scrape every replica that is not DOWN, spread over ``spread_s`` (rule 5; 0 at start-up:
        the first figures are wanted at once)."""
        replicas = await self._store.replicas()
        probers = await self._probers(replicas)
        allowed = [r for r in replicas if self._egress is None or await self._egress.allowed(r.url)]

        async def scrape(r: ReplicaState) -> None:
            await self._scrape_one(r, probers)

        # a DOWN replica is not scraped, but for one that lacked its rank (rule 9) the scrape is how
        # the rank is seen again
        wanted = [r for r in allowed if r.status is not ReplicaStatus.DOWN or r.id in self._rankless]
        await _staggered(wanted, spread_s, scrape)

    async def _probers(self, replicas: Sequence[ReplicaState]) -> frozenset[str]:
        """Rule 8: the live gateways among which probing is divided; refreshes ``_mine``, the replicas
        this gateway is the rendezvous pick for (empty when it is not among them)."""
        probers = frozenset(await self._store.probers())
        ids = frozenset(r.id for r in replicas)
        if (probers, ids) != self._designation:
            self._designation = (probers, ids)
            self._mine = (
                frozenset(rid for rid in ids if hrw_top(rid, probers) == self.writer_id)
                if self.writer_id in probers
                else frozenset()
            )
        return probers

    @property
    def others_live(self) -> bool:
        """Other live gateways share this store (rule 8's probers as of the last scrape round): the
        prefill their requests queue shows only in the engines' loads (policy rule 8)."""
        return any(w != self.writer_id for w in self._designation[0])

    def _leaves_to_another(self, r: ReplicaState, writer: str, probers: frozenset[str]) -> bool:
        """Rules 6-8: whether fresh figures or a fresh check of ``r`` by ``writer`` spare this gateway
        probing it. Someone else's do, unless ``r`` is this gateway's pick and ``writer`` another gateway
        (not a sidecar): then it takes ``r`` over. Its own do only where another live gateway is the
        pick, which takes ``r`` over in its next round."""
        if writer == self.writer_id:
            return self.writer_id in probers and r.id not in self._mine
        return not (r.id in self._mine and writer in probers)

    async def _check_one(self, r: ReplicaState) -> bool:
        """Check ``r`` and apply the state machine; whether the check was good."""
        outcome = ProbeOutcome.FAILED
        detail = ""
        try:
            if self._egress is not None and not await self._egress.allowed(r.url):
                detail = "URL outside the allowed networks: not probed"  # fails like a dead replica
            else:
                status, _ = await self._client.fetch(r.id, r.url + self._cfg.health_path, timeout_s=self._probe_s)
                outcome = ProbeOutcome.OK if status == 200 else ProbeOutcome.FAILED
                detail = f"{self._cfg.health_path} returned {status}"
                if outcome is ProbeOutcome.OK and r.dp_rank is not None:  # rule 9
                    if r.id in self._rankless:
                        outcome, detail = ProbeOutcome.FAILED, self._rankless[r.id]
                    elif r.status is ReplicaStatus.JOINING and r.engine.updated_at <= 0:
                        return False  # its rank's figures not read yet: no verdict
        except UpstreamTimeoutError as exc:
            outcome = ProbeOutcome.TIMEOUT
            detail = str(exc)
        except UpstreamError as exc:
            detail = str(exc)
        if outcome is ProbeOutcome.OK:
            self.health_ok += 1
            self._alive_at[r.id] = self._clock.now()
        suspect = outcome is ProbeOutcome.TIMEOUT and self.suspect(r.id)
        if outcome is ProbeOutcome.TIMEOUT and not suspect:
            self.health_busy += 1
        elif outcome is not ProbeOutcome.OK:
            self.health_failures += 1
            if outcome is ProbeOutcome.TIMEOUT:
                n = self._request_failures.get(r.id, 0)
                detail += f" ({n} failed request(s) since its last success)" if n else (
                    f" (no sign of life for {self._cfg.stall_after_s:g} s)"
                )
        ok = outcome is ProbeOutcome.OK
        async with self._lock:
            # the round's view is enough to decide; re-read only before a change, so an operator's
            # concurrent drain (or a passive ejection) is never overwritten
            prev = self._tracks.get(r.id, HealthTrack())
            track, new = health_transition(r.status, prev, outcome, self._cfg, suspect=suspect)
            self._tracks[r.id] = track
            if new is None:
                return ok
            current = await self._state(r.id)
            if current is None:
                return ok
            if current.status is not r.status:
                track, new = health_transition(current.status, prev, outcome, self._cfg, suspect=suspect)
                self._tracks[r.id] = track
                if new is None:
                    return ok
            if not await self._set_status(r.id, new):
                return ok
            now = self._clock.now()
            if new is ReplicaStatus.DOWN:
                log.warning(
                    "replica %s down after %d failed health checks (%s)", r.id, track.fail_streak, detail
                )
                self._emit(ReplicaEjected(at=now, replica_id=r.id, cause="health", detail=detail))
            elif current.status is ReplicaStatus.JOINING:
                log.info("replica %s active", r.id)
                self._emit(ReplicaActivated(at=now, replica_id=r.id))
            else:
                log.info("replica %s readmitted", r.id)
                self._connect_errors[r.id] = 0
                self._emit(ReplicaReadmitted(at=now, replica_id=r.id))
        return ok

    def _reported_by_another(self, r: ReplicaState, probers: frozenset[str]) -> bool:
        """Rule 6: ``r``'s figures in the store are someone else's and younger than two intervals (and,
        rule 8, not another gateway's on a replica that is this one's to scrape)."""
        e = r.engine
        if e.updated_at <= 0 or not self._leaves_to_another(r, e.reported_by, probers):
            return False
        return self._clock.now() - e.updated_at < 2.0 * self._cfg.scrape_interval_s * (1.0 + self._cfg.jitter)

    async def _scrape_one(self, r: ReplicaState, probers: frozenset[str]) -> None:
        if self._reported_by_another(r, probers):
            self.scrapes_shared += 1
            return
        now = self._clock.now()
        readings = self._readings.setdefault(r.id, LoadReadings())
        load = await self._loads(r, now, readings.host)
        if r.id in self._rankless:  # rule 9: no figures of a rank the engine lacks
            return
        if readings.metrics_due(load):
            load = readings.combine(load, await self._metrics(r, now))
        if load is None:
            return
        self.scrapes_ok += 1
        await self._store.report_engine_load(r.id, replace(load, reported_by=self.writer_id))

    async def _loads(self, r: ReplicaState, now: float, host: EngineLoad | None) -> EngineLoad | None:
        """Rule 4: the load from ``/v1/loads`` (its core figures); ``None`` when the engine has no such
        route (backs off like a missing ``/metrics``), does not answer, or answers nonsense."""
        path = self._cfg.loads_path
        skip = self._loads_off.get(r.id, 0)
        if not path or skip > 0:
            if skip > 0:
                self._loads_off[r.id] = skip - 1
            return None
        try:
            status, body = await self._client.fetch(
                r.id, r.url + path + v1_loads_query(r.dp_rank), accept="application/json", timeout_s=self._probe_s
            )
        except UpstreamError as exc:
            log.debug("%s of %s failed: %s", path, r.id, exc)
            return None
        if status == 404:
            self._loads_off[r.id] = _METRICS_OFF_BACKOFF
            return None
        if status != 200:
            return None
        doc: object = None
        try:
            doc = json.loads(body)
            load = load_from_v1_loads(doc, now=now, host=host, dp_rank=r.dp_rank)
        except (MetricsParseError, ValueError) as exc:
            log.debug("bad %s from %s: %s", path, r.id, exc)
            if r.dp_rank is not None and listed_dp_ranks(doc) is not None:
                await self._check_rank(r, path)
            return None
        self._rankless.pop(r.id, None)
        return load

    async def _check_rank(self, r: ReplicaState, path: str) -> None:
        """Rule 9: a rank replica's filtered ``/v1/loads`` answer did not have its rank (SGLang answers
        an empty list for a rank it lacks, and for one whose first figures are not published yet):
        the whole answer says which."""
        assert r.dp_rank is not None
        try:
            status, body = await self._client.fetch(
                r.id, r.url + path + v1_loads_query(), accept="application/json", timeout_s=self._probe_s
            )
            ranks = listed_dp_ranks(json.loads(body)) if status == 200 else None
        except (UpstreamError, ValueError):
            return
        if not ranks or r.dp_rank in ranks:
            return
        if r.id not in self._rankless:
            log.warning("replica %s: its engine has data-parallel ranks %s, not %d: kept out of service "
                        "(--replica-dp-ranks or the sidecar's --dp-rank?)", r.id, ranks, r.dp_rank)
        self._rankless[r.id] = f"its engine has no data-parallel rank {r.dp_rank} (ranks {ranks})"

    async def _metrics(self, r: ReplicaState, now: float) -> EngineLoad | None:
        """Rule 4: the load from ``/metrics``; ``None`` (a failed scrape, counted) when the engine does
        not answer it sensibly. Backs off after a 404 (SGLang without ``--enable-metrics``)."""
        skip = self._metrics_off.get(r.id, 0)
        if skip > 0:
            self._metrics_off[r.id] = skip - 1
            return None
        try:
            status, body = await self._client.fetch(
                r.id, r.url + self._cfg.metrics_path, accept="text/plain", timeout_s=self._probe_s
            )
        except UpstreamError as exc:
            self.scrapes_failed += 1
            log.debug("scrape of %s failed: %s", r.id, exc)
            return None
        if status == 404:
            self._metrics_off[r.id] = _METRICS_OFF_BACKOFF
            self.scrapes_failed += 1
            log.info("replica %s has no /metrics (SGLang without --enable-metrics?)", r.id)
            return None
        if status != 200:
            self.scrapes_failed += 1
            return None
        try:
            return parse_engine_metrics(body.decode("utf-8", "replace"), now=now, dp_rank=r.dp_rank)
        except MetricsParseError as exc:
            self.scrapes_failed += 1
            log.debug("bad /metrics from %s: %s", r.id, exc)
            return None

    # ---- loops -------------------------------------------------------------------------------------

    async def run_health(self) -> None:
        interval = self._cfg.health_interval_s
        await self._loop(lambda: self.check_health_once(interval * self._cfg.spread), interval, "health")

    async def run_scrape(self) -> None:
        interval = self._cfg.scrape_interval_s
        await self._loop(lambda: self.scrape_once(interval * self._cfg.spread), interval, "scrape")

    async def _loop(self, once: Callable[[], Awaitable[None]], interval_s: float, name: str) -> None:
        # the app runs one round of each before it starts serving: wait a period first. Rounds start
        # one period apart (rule 5): a round that took longer than that is followed at once.
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            j = self._cfg.jitter
            period = interval_s * (1.0 + self._rng.uniform(-j, j))
            await asyncio.sleep(max(0.0, started + period - loop.time()))
            started = loop.time()
            try:
                await once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not kill membership for good
                log.exception("discovery %s round failed", name)

    # ---- helpers -----------------------------------------------------------------------------------

    def _forget_missing(self, replicas: tuple[ReplicaState, ...]) -> None:
        ids = {r.id for r in replicas}
        for d in (
            self._tracks,
            self._connect_errors,
            self._metrics_off,
            self._loads_off,
            self._rankless,
            self._readings,
            self._request_failures,
            self._alive_at,
        ):
            for k in [k for k in d if k not in ids]:
                del d[k]

    async def _state(self, replica_id: ReplicaId) -> ReplicaState | None:
        for r in await self._store.replicas():
            if r.id == replica_id:
                return r
        return None

    async def _set_status(self, replica_id: ReplicaId, status: ReplicaStatus) -> bool:
        try:
            await self._store.set_status(replica_id, status)
        except ReplicaNotFoundError:
            return False  # removed meanwhile
        return True

    def track(self, replica_id: ReplicaId) -> HealthTrack:
        return replace(self._tracks.get(replica_id, HealthTrack()))

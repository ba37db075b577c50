"""Exact cache residency from an engine's KV events. PURE (no I/O, no clock, no randomness).

The question it answers: *how many tokens of session S's own context are resident on replica R
right now, and is that answer exact?* (``ResidencyView.resident_tokens``: an ``int`` when the events
tell it exactly, ``None`` when they do not). *Own*: beyond the prefix S found already cached there
(a system prompt and tools every session shares), which any replica serving such sessions holds too.

Theory of operation
-------------------
SGLang publishes every page its radix cache stores or evicts as a *block* named by a chained hash:
a ``BlockStored`` run names its blocks, the block it hangs below (``parent``) and, when the request
carried a ``session_id``, the session that stored it. A :class:`ReplicaResidency` mirrors one
publisher's cache:

Rule 1 (blocks): ``blocks`` maps every resident block's hash to its parent, its *end* (tokens from
        the root through this block; ``-1`` when an ancestor is unknown) and a mask of the tiers
        holding it (GPU, host, ...). A block leaves when its last tier does.
Rule 2 (tips): each session points at the deepest block it stored (its *tip*); the session's
        resident prefix is the tip's end. A radix cache evicts leaves first, so a session loses its
        tail before its head: when its tip goes, the tip moves up to the nearest ancestor still
        resident (root: nothing left, an exact 0). Only the tip is ever looked at, so a session
        costs one dict entry whatever its length. A tip never moves back down on someone else's
        store: shared blocks another session stores again after this one lost them are credited
        at this session's own next store. So the answer never exceeds what the engine holds.
        A store moves the tip only if it ends at least as deep as the tip now is (or the tip is
        gone): a session's conversations (the parent's and its sub-agents') carry the same id,
        and the one that decides whether the session can move is its longest, the parent's; a
        sub-agent's shorter context stored after it must not make the session look evicted.
        A walk up that meets a cycle (a publisher naming a block its own ancestor) leaves the
        session unknown (``None``) rather than looping.
Rule 2b (own part): each session also keeps its *base*, the end of the block its first stored run
        hung below (what it found cached when it first stored there: the prefix it shares with the
        sessions before it; the lowest such end if it later stores from higher up the tree). The
        answer is the tip's end minus the base: a session whose own blocks are all gone reads 0
        though the shared prefix is still resident, because moving it elsewhere costs nothing more.
Rule 3 (completeness): a publisher is *complete* when every block in its cache is known to us: we
        have applied every batch since an empty cache (``AllBlocksCleared``, which SGLang emits when
        its cache is created or flushed, or a rebuild from sequence 0 through the replay socket).
        After a gap the mirror's blocks are dropped, its sessions made unknown, and it is marked
        incomplete: sessions stored afterwards from the root are still exact, anything hanging
        below an unknown block is ``None``, and the replica's ``source`` reads ``estimate`` until
        the next complete point.
Rule 4 (stale): while its subscriber is disconnected a mirror answers ``None`` (the engine may be
        gone with its cache, or changing it unseen).
Rule 5 (untracked sessions): on a complete publisher a session with no entry has nothing of its
        own there (0); on an incomplete one it is unknown (``None``).
Rule 6 (bounds): at most ``max_blocks`` blocks (beyond that the mirror cannot be exact: it is
        dropped and marked incomplete) and ``max_sessions`` session entries (least recently
        changed dropped first, a store that leaves the tip where it is counting as a change; a dropped
        session reads as rule 5 says).
Rule 7 (a tip of unknown depth): on an incomplete mirror a session that stored below a block we
        never saw has a tip whose end is unknown, so its tokens are ``None``; but a radix cache
        evicts leaves first, so while that tip is resident all of the session's context up to it
        is too. ``tip_on`` names such replicas, for a session the store does not know: after an
        engine's replay buffer has rolled (SGLang keeps its last 10,000 batches) a restarted
        gateway still finds the sessions that stored in that window.
Rule 8 (lag): the events of a turn's stores reach us after its response does. A session that
        finished a turn on its home but has no entry there (rule 5's 0) is unknown to
        ``with_residency``, not gone: its next turn, sent before those events arrive, must not
        look evicted (the estimate decides it instead).

Memory and cost per event are measured by ``kvroute bench kv-events`` (docs/KV_EVENTS.md).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from typing import Protocol

from router.model import ClusterSnapshot, SessionState
from router.policy.hashing import hrw_weight

__all__ = [
    "ESTIMATE",
    "EVENTS",
    "OFF",
    "ReplicaResidency",
    "ResidencyIndex",
    "ResidencyView",
    "merged_source",
    "snapshot_with_residency",
    "unbound_with_residency",
    "with_residency",
]

EVENTS = "events"  # every rank of the replica is complete (rule 3)
ESTIMATE = "estimate"  # events are subscribed to but incomplete: the policy must estimate
OFF = "off"  # nobody subscribes to this replica's events

_UNKNOWN_END = -1
# tip sentinels (block hashes are int64, these are not)
_ZERO = 1 << 64  # the session had blocks here and lost them all: exactly 0 resident
_UNKNOWN = (1 << 64) + 1  # the session's tip went below a block we never saw: unknown
# steps of a walk up the tree before it starts to look for a cycle (no set to build on the common,
# short walks: a radix cache evicts leaves first, so the nearest resident ancestor is close)
_WALK_UNCHECKED = 64


class ResidencyView(Protocol):
    """Read side, what the stores and the admin API use (sync, O(1) per call)."""

    def resident_tokens(self, replica_id: str, session_id: str) -> int | None:
        """Tokens of the session's own prefix resident on the replica (any tier; rule 2b: beyond what
        it found cached there); ``None``: not known."""
        ...

    def resident_on(self, session_id: str) -> tuple[tuple[str, int], ...]:
        """``(replica, tokens)`` for every replica where the session is known to hold > 0 tokens."""
        ...

    def tip_on(self, session_id: str) -> tuple[str, ...]:
        """Replicas not in ``resident_on`` whose mirror holds the session's last stored block, of
        unknown depth (rule 7)."""
        ...

    def tracks(self, replica_id: str, session_id: str) -> bool:
        """Have the replica's events named the session (an entry: its tip, or the exact 0 its tip
        became when its blocks went)? Rule 5's 0 for a session with no entry is "never stored
        here" only as far as the events have come (rule 8)."""
        ...

    def source(self, replica_id: str) -> str:
        """``events`` (complete), ``estimate`` (subscribed, incomplete) or ``off``."""
        ...


# a block: (parent hash or None, end in tokens or -1, tiers mask); a plain tuple of ints is not
# tracked by the garbage collector, which matters at a million blocks
_Block = tuple[int | None, int, int]


class ReplicaResidency:
    """One publisher's cache (one replica, or one DP rank of it), fed event by event.

    Implements ``router.kv_wire.EventSink`` (``stored`` / ``removed`` / ``cleared``).
    """

    def __init__(self, max_blocks: int = 3_000_000, max_sessions: int = 200_000, track_changes: bool = False) -> None:
        if max_blocks <= 0 or max_sessions <= 0:
            raise ValueError("max_blocks and max_sessions must be > 0")
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self.blocks: dict[int, _Block] = {}
        self.tipped: dict[int, list[str]] = {}  # block -> sessions whose tip it is
        self.tips: OrderedDict[str, int] = OrderedDict()  # session -> tip; least recently changed first
        self.bases: dict[str, int] = {}  # session -> end of what it found cached (rule 2b)
        self.complete = False
        self.stale = False  # set by a subscriber while it is not connected: answers are None
        # changes since the last ``take_changes`` (for the Redis writer); None = not tracked
        self._changed: set[str] | None = set() if track_changes else None
        self._reset_pending = False
        # counters
        self.events = 0
        self.stores = 0
        self.removals = 0
        self.clears = 0
        self.overflows = 0
        self.unknown_parents = 0
        self.unknown_removals = 0

    # ---- queries ---------------------------------------------------------------------------
    def resident_tokens(self, session_id: str) -> int | None:
        if self.stale:
            return None
        t = self.tips.get(session_id)
        if t is None:
            return 0 if self.complete else None
        if t == _ZERO:
            return 0
        if t == _UNKNOWN:
            return None
        b = self.blocks.get(t)
        if b is None or b[1] < 0:
            return None
        return max(0, b[1] - self.bases.get(session_id, 0))

    def tracks(self, session_id: str) -> bool:
        return not self.stale and session_id in self.tips

    def tip_resident(self, session_id: str) -> bool:
        """Rule 7: the session's tip is a resident block whose depth is unknown."""
        if self.stale:
            return False
        t = self.tips.get(session_id)
        b = None if t is None else self.blocks.get(t)
        return b is not None and b[1] < 0 and b[2] != 0

    @property
    def resident_blocks(self) -> int:
        return len(self.blocks)

    @property
    def sessions(self) -> int:
        return len(self.tips)

    # ---- EventSink ---------------------------------------------------------------------------
    def stored(
        self,
        parent: int | None,
        hashes: list[int],
        block_tokens: int,
        total_tokens: int,
        medium: int,
        session_id: str | None,
    ) -> None:
        self.events += 1
        self.stores += 1
        blocks = self.blocks
        if parent is None:
            base = 0
        else:
            pb = blocks.get(parent)
            if pb is None:
                base = _UNKNOWN_END
                self.unknown_parents += 1
            else:
                base = pb[1]
        n = len(hashes)
        step = block_tokens if block_tokens > 0 else 1
        if base < 0:
            ends: Iterable[int] = repeat(_UNKNOWN_END, n)
        else:
            last = base + (total_tokens if total_tokens else n * step)
            ends = chain(range(base + step, base + n * step, step), (last,)) if n else ()
        if blocks.keys().isdisjoint(hashes):
            # the common case, at C speed: a run of new blocks, each below the one before it
            blocks.update(zip(hashes, zip(chain((parent,), hashes), ends, repeat(medium))))
        else:  # some are known (stored again on another tier): add the tier to those
            prev = parent
            for h, e in zip(hashes, ends):
                b = blocks.get(h)
                blocks[h] = (prev, e, medium) if b is None else (b[0], b[1], b[2] | medium)
                prev = h
        if session_id is not None and hashes:
            # an unknown parent's end counts as 0: the answer may then include shared tokens (safe:
            # the session looks more resident, so it is not moved for it)
            start = max(base, 0)
            if start < self.bases.get(session_id, start + 1):
                self.bases[session_id] = start
            if self._deeper(session_id, blocks[hashes[-1]][1]):
                self._set_tip(session_id, hashes[-1])
            else:  # a shallower store of a live session keeps it among the recently changed (rule 6)
                self.tips.move_to_end(session_id)
        if len(blocks) > self.max_blocks:
            self.overflows += 1
            self.reset_incomplete()

    def removed(self, hashes: list[int], medium: int) -> None:
        self.events += 1
        self.removals += 1
        blocks = self.blocks
        gone: list[int] = []
        for h in hashes:
            b = blocks.get(h)
            if b is None:
                self.unknown_removals += 1
                continue
            m = b[2] & ~medium
            blocks[h] = (b[0], b[1], m)
            if not m:
                gone.append(h)
        if not gone:
            return
        # gone blocks stay in ``blocks`` (tiers 0) until every tip on them has moved (rule 2)
        tipped = self.tipped
        for h in gone:
            sids = tipped.pop(h, None)
            if not sids:
                continue
            p = blocks[h][0]
            new = _ZERO
            steps = 0
            seen: set[int] | None = None
            while p is not None:
                pb = blocks.get(p)
                if pb is None:
                    new = _UNKNOWN
                    break
                if pb[2]:
                    new = p
                    break
                # a publisher can name a block as its own ancestor (a bug, or hostile): past a depth
                # honest eviction rarely walks, remember the way up, and a loop makes it unknown
                steps += 1
                if steps > _WALK_UNCHECKED:
                    if seen is None:
                        seen = set()
                    elif p in seen:
                        new = _UNKNOWN
                        break
                    seen.add(p)
                p = pb[0]
            for sid in sids:
                self._move_tip(sid, new)
        for h in gone:
            del blocks[h]

    def cleared(self) -> None:
        """``AllBlocksCleared``: the engine's cache is empty, so we know all of it (rule 3)."""
        self.events += 1
        self.clears += 1
        self.blocks.clear()
        self.tipped.clear()
        for sid in self.tips:
            self.tips[sid] = _ZERO
        self.complete = True
        if self._changed is not None:
            self._changed.update(self.tips)

    # ---- resync ------------------------------------------------------------------------------
    def reset_incomplete(self) -> None:
        """Events were lost (or the mirror overflowed): forget every block, rule 3. The sessions
        stay, unknown until the next complete point makes them an exact 0 or their stores come
        again: a session this replica's events once named is never mistaken for one whose
        events have not come yet (rule 8)."""
        self.blocks.clear()
        self.tipped.clear()
        for sid in self.tips:
            self.tips[sid] = _UNKNOWN
        self.bases.clear()
        self.complete = False
        if self._changed is not None:
            self._changed.clear()
            self._reset_pending = True

    def take_changes(self) -> tuple[bool, list[tuple[str, int | None]]]:
        """``(reset, [(session, resident tokens or None)])`` since the last call: what a writer
        must publish (``reset``: drop everything published for this replica first)."""
        if self._changed is None:
            return False, []
        reset, self._reset_pending = self._reset_pending, False
        out = [(sid, self.resident_tokens(sid)) for sid in self._changed]
        self._changed.clear()
        return reset, out

    # ---- internals ---------------------------------------------------------------------------
    def _deeper(self, sid: str, end: int) -> bool:
        """Rule 2: does a store ending at ``end`` become the session's tip (not if its tip is deeper)?"""
        t = self.tips.get(sid)
        if t is None or t == _ZERO or t == _UNKNOWN or end < 0:
            return True
        b = self.blocks.get(t)
        return b is None or b[1] < 0 or end >= b[1]

    def _set_tip(self, sid: str, h: int) -> None:
        tips = self.tips
        old = tips.get(sid)
        if old == h:
            tips.move_to_end(sid)
            return
        if old is not None:
            self._untip(sid, old)
        self.tipped.setdefault(h, []).append(sid)
        tips[sid] = h
        tips.move_to_end(sid)
        if self._changed is not None:
            self._changed.add(sid)
        if len(tips) > self.max_sessions:
            self._drop_oldest_session()

    def _untip(self, sid: str, h: int) -> None:
        sids = self.tipped.get(h)
        if sids:
            try:
                sids.remove(sid)
            except ValueError:
                return
            if not sids:
                del self.tipped[h]

    def _move_tip(self, sid: str, new: int) -> None:
        self.tips[sid] = new
        self.tips.move_to_end(sid)
        if new != _ZERO and new != _UNKNOWN:
            self.tipped.setdefault(new, []).append(sid)
        if self._changed is not None:
            self._changed.add(sid)

    def _drop_oldest_session(self) -> None:
        sid, t = self.tips.popitem(last=False)
        self.bases.pop(sid, None)
        self._untip(sid, t)
        if self._changed is not None:
            self._changed.add(sid)


def with_residency(session: SessionState, view: ResidencyView | None, engine_id: str | None = None) -> SessionState:
    """``session`` with ``resident_tokens`` (on its home) and ``resident_on`` filled from ``view``.
    ``engine_id``: the id the engine names this request's blocks by, when the request's body names
    one other than the session's (SGLang's body ``session_id``); its reading replaces the session's."""
    if view is None:
        return session
    sid = session.session_id if engine_id is None else engine_id
    home = None if session.home is None else view.resident_tokens(session.home, sid)
    if home == 0 and session.residency_mark > 0 and not view.tracks(session.home or "", sid):
        home = None  # rule 8: a turn finished there whose stores have not reached us yet
    on = view.resident_on(sid)
    if engine_id is None and home is None and not on:
        return session
    return dataclasses.replace(session, resident_tokens=home, resident_on=on)


def unbound_with_residency(session_id: str, view: ResidencyView | None) -> SessionState | None:
    """A session the store does not know, as the engines' events know it: a state with only
    ``resident_on`` and ``tip_on`` filled when some replica holds its blocks (its binding expired,
    or the gateway restarted on embedded state), else ``None``."""
    if view is None:
        return None
    on, tips = view.resident_on(session_id), view.tip_on(session_id)
    return SessionState(session_id, resident_on=on, tip_on=tips) if on or tips else None


def snapshot_with_residency(
    snap: ClusterSnapshot, view: ResidencyView | None, session_key: str | None = None
) -> ClusterSnapshot:
    if view is None:
        return snap
    if snap.session is None:
        found = unbound_with_residency(session_key, view) if session_key else None
        return snap if found is None else dataclasses.replace(snap, session=found)
    s = with_residency(snap.session, view)
    return snap if s is snap.session else dataclasses.replace(snap, session=s)


def merged_source(sources: Iterable[str]) -> str:
    """One replica's source from its ranks': ``events`` only when all are."""
    out = OFF
    for s in sources:
        if s == ESTIMATE:
            return ESTIMATE
        out = s if s == EVENTS else out
    return out


class ResidencyIndex:
    """Every subscribed replica (one :class:`ReplicaResidency` per DP rank). Implements
    :class:`ResidencyView`; the subscribers (``router.kv_events``) or the simulator feed it."""

    def __init__(self, max_blocks: int = 3_000_000, max_sessions: int = 200_000, track_changes: bool = False) -> None:
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self.track_changes = track_changes
        self._reps: dict[str, list[ReplicaResidency]] = {}
        self._order: tuple[str, ...] = ()  # replica ids, sorted (resident_on runs per request)

    def replica(self, replica_id: str, rank: int = 0, dp_size: int = 1) -> ReplicaResidency:
        """The mirror of one rank (created on first use; ``dp_size`` ranks per replica)."""
        ranks = self._reps.get(replica_id)
        if ranks is None or len(ranks) != dp_size:
            ranks = self._reps[replica_id] = [
                ReplicaResidency(self.max_blocks, self.max_sessions, self.track_changes) for _ in range(dp_size)
            ]
            self._order = tuple(sorted(self._reps))
        return ranks[rank]

    def ranks(self, replica_id: str) -> tuple[ReplicaResidency, ...]:
        return tuple(self._reps.get(replica_id, ()))

    def drop(self, replica_id: str) -> None:
        if self._reps.pop(replica_id, None) is not None:
            self._order = tuple(sorted(self._reps))

    def replica_ids(self) -> tuple[str, ...]:
        return self._order

    # ---- ResidencyView -----------------------------------------------------------------------
    def resident_tokens(self, replica_id: str, session_id: str) -> int | None:
        ranks = self._reps.get(replica_id)
        if not ranks:
            return None
        if len(ranks) == 1:
            return ranks[0].resident_tokens(session_id)
        # a session lives on one rank: the rank holding it answers; an unknown rank leaves a 0 unknown
        best = 0
        unknown = False
        for r in ranks:
            v = r.resident_tokens(session_id)
            if v is None:
                unknown = True
            elif v > best:
                best = v
        return None if unknown and best == 0 else best

    def tracks(self, replica_id: str, session_id: str) -> bool:
        return any(r.tracks(session_id) for r in self._reps.get(replica_id, ()))

    def resident_on(self, session_id: str) -> tuple[tuple[str, int], ...]:
        out: list[tuple[str, int]] = []
        for rid in self._order:
            v = self.resident_tokens(rid, session_id)
            if v:
                out.append((rid, v))
        return tuple(out)

    def rank_for(self, replica_id: str, session_id: str, busy: Sequence[int] = ()) -> int | None:
        """The data-parallel rank for a session's next request to a replica of several: the rank
        holding most of the session's own cache, else (cached on none) the least busy rank (``busy``:
        requests in flight on each, as the caller counts them), then the one holding the fewest
        blocks, where a new cache has the most room; equal ranks: the session's rendezvous order, so
        sessions placed at once spread. ``None``: one rank, or not every rank is known (the caller
        then hashes)."""
        ranks = self._reps.get(replica_id)
        if ranks is None or len(ranks) < 2:
            return None
        best, most = None, 0
        for i, r in enumerate(ranks):
            v = r.resident_tokens(session_id)
            if v is None:
                return None
            if v > most:
                best, most = i, v
        if best is not None:
            return best

        def room(i: int) -> tuple[int, int, float]:
            return (busy[i] if i < len(busy) else 0, ranks[i].resident_blocks, -hrw_weight(session_id, str(i)))

        return min(range(len(ranks)), key=room)

    def tip_on(self, session_id: str) -> tuple[str, ...]:
        out: list[str] = []
        for rid in self._order:
            if any(r.tip_resident(session_id) for r in self._reps[rid]) and not self.resident_tokens(rid, session_id):
                out.append(rid)
        return tuple(out)

    def source(self, replica_id: str) -> str:
        ranks = self._reps.get(replica_id)
        if not ranks:
            return OFF
        return EVENTS if all(r.complete and not r.stale for r in ranks) else ESTIMATE

    def stats(self) -> dict[str, dict[str, int | str]]:
        out: dict[str, dict[str, int | str]] = {}
        for rid in sorted(self._reps):
            ranks = self._reps[rid]
            out[rid] = {
                "source": self.source(rid),
                "blocks": sum(r.resident_blocks for r in ranks),
                "sessions": sum(r.sessions for r in ranks),
                "events": sum(r.events for r in ranks),
                "overflows": sum(r.overflows for r in ranks),
            }
        return out

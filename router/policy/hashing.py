"""Rendezvous (highest-random-weight) hashing with mmh3.

mmh3 is seeded explicitly and never salted per process (unlike Python's ``hash()``), so every
gateway, the simulator and the tests rank replicas identically for a key. Adding a replica moves
only the keys it now wins; removing one moves only the keys it held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import mmh3

__all__ = ["HrwTopCache", "hrw_rank", "hrw_slot", "hrw_top", "hrw_weight", "utf8"]

_SEED = 0x6B76  # "kv": fixed forever, changing it remaps every stateless key


def utf8(text: str) -> str | bytes:
    """What mmh3 may hash for ``text``: ``text`` itself when ASCII (an O(1) check), else its UTF-8
    bytes - the same hash mmh3 computes for a ``str`` - with lone surrogates kept as their 3-byte
    form. mmh3 5.x dereferences NULL on a ``str`` it cannot encode (a JSON ``"\\ud800"``, a header
    byte that is not UTF-8): a segfault that takes the whole gateway down."""
    return text if text.isascii() else text.encode("utf-8", "surrogatepass")


def hrw_weight(key: str, replica_id: str) -> int:
    """The weight of ``replica_id`` for ``key``: an unsigned 64-bit mmh3 hash of both."""
    h: int = mmh3.hash64(utf8(f"{key}\x00{replica_id}"), _SEED, signed=False)[0]
    return h


def hrw_rank(key: str, replica_ids: Iterable[str]) -> list[str]:
    """Replica ids ordered by rendezvous weight for ``key``, best first (ties by id)."""
    return sorted(replica_ids, key=lambda rid: (-hrw_weight(key, rid), rid))


def hrw_top(key: str, replica_ids: Iterable[str]) -> str | None:
    """The rendezvous winner for ``key``, or ``None`` if there is no replica."""
    best: str | None = None
    best_w = -1
    for rid in replica_ids:
        w = hrw_weight(key, rid)
        if w > best_w or (w == best_w and best is not None and rid < best):
            best, best_w = rid, w
    return best


def hrw_slot(key: str, n: int) -> int:
    """The rendezvous winner for ``key`` among the slots ``0 .. n-1`` (an engine's data-parallel ranks):
    the same slot for the same key and ``n`` on every gateway."""
    return int(hrw_top(key, map(str, range(n))) or 0)


class HrwTopCache:
    """``hrw_top`` remembered per key for one candidate set: the winner of a key only changes when
    the set does, and a large fleet makes ``hrw_top`` one hash per replica. Same answers as
    ``hrw_top``; forgets everything when the set changes or ``max_keys`` is reached.

    ``replica_ids`` is a tuple of ids or a mapping keyed by them (e.g. ``ClusterSnapshot.positions``,
    which a store replaces rather than mutates: the same object is recognised without a compare)."""

    def __init__(self, max_keys: int = 1 << 17) -> None:
        self.max_keys = max_keys
        self._ids: tuple[str, ...] | Mapping[str, int] | None = None
        self._top: dict[str, str | None] = {}

    def top(self, key: str, replica_ids: tuple[str, ...] | Mapping[str, int]) -> str | None:
        if (replica_ids is not self._ids and replica_ids != self._ids) or len(self._top) >= self.max_keys:
            self._ids = replica_ids
            self._top = {}
        try:
            return self._top[key]
        except KeyError:
            best = self._top[key] = hrw_top(key, replica_ids)
            return best

from __future__ import annotations

import pytest

from loadtests.sim.prompts import ChainNamer, IdealCache, check_page_size
from loadtests.workloads import SessionSpec, Turn, runs_of


def test_synthetic_names_share_the_system_prefix_across_sessions_only() -> None:
    a = SessionSpec("a", 0.0, 1024, (Turn(1000, 100, 0.0), Turn(300, 50, 1.0), Turn(600, 10, 1.0, reset=True)))
    b = SessionSpec("b", 0.0, 1024, (Turn(2000, 100, 0.0),))
    na, nb = ChainNamer(a, 1, 1, 256), ChainNamer(b, 2, 2, 256)
    a0, b0 = na.names(0), nb.names(0)
    assert len(a0) == (1024 + 1000) // 256 and len(b0) == (1024 + 2000) // 256
    assert a0[:4] == b0[:4]  # 1024 shared tokens = 4 global blocks
    assert a0[4] != b0[4]
    a1 = na.names(1)
    assert a1[: len(a0)] == a0  # append-only context: turn 1 extends turn 0
    full0 = na.full_names(0, a0)
    assert len(full0) == (1024 + 1000 + 100) // 256 and full0[: len(a0)] == a0
    assert a1[: len(full0)] == full0  # the output is part of the next prompt
    a2 = na.names(2)  # compaction: a new epoch, only the system prefix survives
    assert a2[:4] == a0[:4] and a2[4] not in set(a1)


def test_trace_names_follow_hash_ids_and_scope() -> None:
    # 64-token trace blocks, 128-token pages: page b is named by trace block 2b+1
    t0 = Turn(0, 64, 0.0, input_tokens=640, hash_runs=runs_of(range(1, 11)))
    t1 = Turn(0, 10, 1.0, input_tokens=1024, hash_runs=runs_of([*range(1, 13), 50, 51, 52, 53]))
    s1 = SessionSpec("w1", 0.0, 0, (t0, t1), block_size=64, hash_scope="session", source="weka")
    s2 = SessionSpec("w2", 0.0, 0, (t0,), block_size=64, hash_scope="session", source="weka")
    n1, n2 = ChainNamer(s1, 1, 1, 128), ChainNamer(s2, 2, 2, 128)
    p0 = n1.names(0)
    assert len(p0) == 5
    assert n2.names(0) != p0  # session-local ids: same numbers, different sessions, no sharing
    full = n1.full_names(0, p0)  # prompt 640 + output 64 = 704 tokens -> 5 pages; next turn agrees
    assert full == p0
    p1 = n1.names(1)
    assert p1[:5] == p0 and len(p1) == 8
    # global scope (Mooncake): equal ids share across sessions; 512-token blocks split in 4 pages
    g = Turn(0, 1, 0.0, input_tokens=1024, hash_runs=runs_of([7, 8]))
    ga = ChainNamer(SessionSpec("m1", 0.0, 0, (g,), block_size=512, hash_scope="global"), 1, 1, 128)
    gb = ChainNamer(SessionSpec("m2", 0.0, 0, (g,), block_size=512, hash_scope="global"), 2, 2, 128)
    assert ga.names(0) == gb.names(0) and len(set(ga.names(0))) == 8


def test_page_size_must_align_with_trace_blocks() -> None:
    s = SessionSpec("w", 0.0, 0, (Turn(0, 1, 0.0, input_tokens=100, hash_runs=((1, 2),)),), block_size=64)
    with pytest.raises(ValueError):
        ChainNamer(s, 1, 1, 96)
    with pytest.raises(ValueError, match="block size 64"):
        check_page_size([s], 96)
    check_page_size([s], 128)
    check_page_size([s], 32)


def test_ideal_cache_matches_like_the_engine() -> None:
    c = IdealCache(100)
    assert c.hit_tokens([1, 2, 3], 300) == 0
    c.add([1, 2, 3])
    assert c.hit_tokens([1, 2, 3], 301) == 300
    assert c.hit_tokens([1, 2, 3], 300) == 200  # at least one token is always computed
    assert c.hit_tokens([1, 9, 3], 1000) == 100

"""Block hash names for a workload's prompts, at the simulated cache's page size.

The emulator's ``PrefixCache`` keys blocks by *chained* hashes: one name stands for the whole
prefix up to the end of its block. The simulator never renders text; it names blocks so that two
prompts share a block name exactly when they share the prefix through that block:

* synthetic chains (no ``hash_runs``): the context is append-only between resets, so block ``j``
  of a chain's epoch ``e`` is ``chain_base(uid, e) + j``; blocks lying entirely inside the shared
  system+tools prefix get *global* names (``shared_base + j``, prefix-stable), so every session
  with the same prefix hits them (cross-session sharing);
* trace chains (``hash_runs``, trace block size ``B``): simulated block ``b`` ends at token
  ``(b+1)P - 1``, inside trace block ``t``; its name is ``scope_base + id_t * K + sub`` where
  ``K = max(1, B // P)`` sub-blocks per trace block. ``hash_scope == "session"`` ids are
  namespaced per routing key (WEKA: sub-agents share the parent's namespace); the first
  ``shared_prefix_tokens`` get global names as for synthetic chains (calibration §5: WEKA's
  hashes are session-local but every Claude Code session starts with ~15k shared tokens).

With ``framing_tokens`` > 0 a synthetic chain is named as the live load driver renders it
(``loadtests.textgen.Conversation``: the session's history is ONE growing user message): turn
``k``'s prompt ends with the chat template's closing marker and generation prompt
(``framing_tokens``), which the next turn replaces with more history, and the engine's generated
output is not the text the driver sends back as the reply. So the next turn reuses turn ``k``'s
prompt only up to the page holding the marker; those tail pages and the output's pages get names of
their own (they fill the cache, and never hit).

``ChainNamer.names(k)`` gives the prompt's block names of turn ``k`` and
``ChainNamer.full_names(k)`` the names of prompt + output (what the engine caches when the request
finishes: SGLang keeps the generated tokens in its radix tree). For traces the output's names are
taken from the next turn when it continues the same prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from loadtests.workloads import SessionSpec, SyntheticSessions, turn_inputs

__all__ = ["ChainNamer", "IdealCache", "check_page_size"]

_CHAIN_SPAN = 1 << 24  # blocks per chain epoch (2^24 x page tokens: never reached)
_EPOCH_SPAN = 1 << 12
_SHARED_BASE = 1 << 62
_TAIL_BASE = 1 << 61
_SCOPE_BASE = 1 << 56
_TURN_SPAN = 1 << 12  # turns per chain in tail names


def _aligned(page_size: int, block_size: int) -> bool:
    if not block_size:
        return True
    if page_size >= block_size:
        return page_size % block_size == 0
    return block_size % page_size == 0


def check_page_size(specs: Iterable[SessionSpec], page_size: int) -> None:
    """``ValueError`` unless ``page_size`` is a multiple or a divisor of every trace block size."""
    if page_size <= 0:
        raise ValueError("page size must be > 0")
    if isinstance(specs, SyntheticSessions):
        return  # synthetic chains carry no trace hashes (block size 0); reading them would make them all
    sizes = {c.block_size for s in specs for c in s.walk()}
    bad = sorted(b for b in sizes if not _aligned(page_size, b))
    if bad:
        raise ValueError(f"page size {page_size} must be a multiple or a divisor of the trace block size {bad[0]}")


_SHARED_NAMES: list[int] = []
"""The shared prefix's block names made so far in this process, handed out as slices: every chain
holds the same int objects, so the caches' list compares short-cut on identity."""


def _shared_names(n: int) -> list[int]:
    """Blocks ``0..n-1`` of the shared system + tools prefix (block ``j`` is ``_SHARED_BASE + j``).
    The prefix is prefix-stable (as the live driver's ``loadtests.textgen.shared_prefix`` is):
    sessions whose shared prefixes differ in length share the shorter one."""
    made = _SHARED_NAMES
    if len(made) < n:
        made.extend(range(_SHARED_BASE + len(made), _SHARED_BASE + n))
    return made[:n]


class ChainNamer:
    """Names of the blocks of every turn of one chain (a session or one of its branches)."""

    __slots__ = (
        "_epochs", "_framing", "_inputs", "_k", "_made", "_made_epoch", "_memo", "_scope_base", "_spec", "_uid", "page",
    )

    def __init__(self, spec: SessionSpec, uid: int, scope_uid: int, page_size: int, framing_tokens: int = 0) -> None:
        if not _aligned(page_size, spec.block_size):
            raise ValueError(
                f"page size {page_size} must be a multiple or a divisor of the trace block size {spec.block_size}"
            )
        self._spec = spec
        self._uid = uid
        self.page = page_size
        self._framing = max(0, framing_tokens)
        self._inputs = turn_inputs(spec)
        self._scope_base = 0 if spec.hash_scope == "global" else _SCOPE_BASE + scope_uid * (1 << 40)
        self._k = max(1, spec.block_size // page_size) if spec.block_size else 1
        epochs: list[int] = []
        e = 0
        for i, t in enumerate(spec.turns):
            if i > 0 and t.reset:
                e += 1
            epochs.append(e)
        self._epochs = epochs
        self._memo: dict[int, list[int]] = {}
        self._made: list[int] = []  # synthetic: the longest names of epoch ``_made_epoch`` so far
        self._made_epoch = -1

    @property
    def inputs(self) -> tuple[int, ...]:
        return self._inputs

    def _synthetic(self, k: int, n_tokens: int) -> list[int]:
        """Block ``j`` is shared name ``j`` inside the shared prefix, else ``base + j``: the names of a
        shorter prompt of the same epoch are a prefix of a longer one's. They are cut from one list
        per epoch, grown as the chain's prompts grow, so consecutive turns hold the same int objects
        (the caches compare a turn's names with the previous turn's: identical objects compare at
        once) and a turn makes only its new names."""
        page = self.page
        n = n_tokens // page
        epoch = self._epochs[k]
        if epoch != self._made_epoch:
            self._made, self._made_epoch = [], epoch
        made = self._made
        have = len(made)
        if have < n:
            shared = self._spec.shared_prefix_tokens // page
            if have < shared:
                made.extend(_shared_names(min(n, shared))[have:])
            base = (self._uid * _EPOCH_SPAN + epoch) * _CHAIN_SPAN
            made.extend(range(base + max(have, shared), base + n))
        return made[:n]

    def _trace(self, k: int, n_tokens: int) -> list[int]:
        spec = self._spec
        page = self.page
        bsz = spec.block_size
        n = n_tokens // page
        kk = self._k
        base = self._scope_base
        runs = spec.turns[k].hash_runs
        out: list[int] = []
        append = out.append
        shared = 0
        if spec.hash_scope != "global":
            shared = min(n, spec.shared_prefix_tokens // page)
            out.extend(_shared_names(shared))
        # walk the runs: trace block index t -> id
        run_i = 0
        run_start_idx = 0  # trace index of the current run's first block
        for b in range(shared, n):
            end_tok = (b + 1) * page - 1
            t = end_tok // bsz
            while run_i < len(runs) and t >= run_start_idx + runs[run_i][1]:
                run_start_idx += runs[run_i][1]
                run_i += 1
            if run_i >= len(runs):
                break  # the trace has fewer blocks than the prompt's tokens: stop naming
            tid = runs[run_i][0] + (t - run_start_idx)
            sub = (end_tok % bsz) // page if kk > 1 else 0
            append(base + tid * kk + sub)
        return out

    def _tail(self, k: int, names: list[int], blocks: int) -> list[int]:
        """``names`` up to the page holding turn ``k``'s closing marker, then names of this turn's own
        up to ``blocks`` (``framing_tokens``: what the next turn does not reuse)."""
        content = min(len(names), max(0, (self._inputs[k] - self._framing) // self.page))
        tail = _TAIL_BASE + (self._uid * _TURN_SPAN + k % _TURN_SPAN) * _CHAIN_SPAN
        return names[:content] + list(range(tail + content, tail + blocks))

    def names(self, k: int) -> list[int]:
        """Block names of turn ``k``'s prompt (full pages only)."""
        got = self._memo.pop(k, None)
        if got is None:
            if self._spec.turns[k].hash_runs and self._spec.block_size:
                got = self._trace(k, self._inputs[k])
            else:
                got = self._synthetic(k, self._inputs[k])
        if self._framing:
            return self._tail(k, got, self._inputs[k] // self.page)
        return got

    def full_names(self, k: int, prompt: Sequence[int]) -> list[int]:
        """Names of the blocks of prompt + output of turn ``k`` (``prompt`` = ``names(k)``)."""
        spec = self._spec
        total = (self._inputs[k] + spec.turns[k].output_tokens) // self.page
        if self._framing:
            return self._tail(k, list(prompt), total)
        if not (spec.turns[k].hash_runs and spec.block_size):
            return self._synthetic(k, self._inputs[k] + spec.turns[k].output_tokens)
        if k + 1 >= len(spec.turns):
            return list(prompt)
        nxt = self._memo.get(k + 1)
        if nxt is None:
            nxt = self._trace(k + 1, self._inputs[k + 1])
            self._memo[k + 1] = nxt
        n = len(prompt)
        if len(nxt) < n or (n and nxt[n - 1] != prompt[-1]):
            return list(prompt)  # the next turn rewrote the context: nothing more to name
        return list(prompt) + nxt[n:total]

    def forget(self) -> None:
        self._memo.clear()
        self._made = []


class IdealCache:
    """One infinite cache shared by every replica: what ``ideal_chr`` is measured against.

    Names are chained (one name = one whole prefix) and ``add`` always receives whole prefixes, so
    along any prompt the seen names form a prefix: a binary search finds the hit length.
    """

    __slots__ = ("_seen", "page")

    def __init__(self, page_size: int) -> None:
        self._seen: set[int] = set()
        self.page = page_size

    def hit_tokens(self, names: Sequence[int], prompt_tokens: int) -> int:
        """Cached tokens an infinite cache would report (same matching rule as the engine)."""
        n = min(len(names), (prompt_tokens - 1) // self.page)
        seen = self._seen
        lo, hi = 0, n  # invariant: names[:lo] all seen; names[hi:] none seen
        while lo < hi:
            mid = (lo + hi) // 2
            if names[mid] in seen:
                lo = mid + 1
            else:
                hi = mid
        return lo * self.page

    def add(self, names: Sequence[int], known: int = 0) -> None:
        """Add a whole prefix; its first ``known`` names are already in (skipped)."""
        self._seen.update(names[known:] if known else names)

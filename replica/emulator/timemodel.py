"""A pure, event-driven model of one SGLang replica: continuous batching over a prefix cache.

No I/O, no clock reads, no asyncio: ``now`` is always passed in (modelled seconds). The live
emulator drives it with scaled wall time; the fleet simulator drives it with virtual time.

Theory of operation
-------------------
The engine is one GPU "server" that runs one *operation* at a time, as SGLang's scheduler loop
does (``--enable-mixed-chunk`` off):

Rule 1 (prefill first): when a prefill can run it runs. A prefill forward packs, FCFS, the
        request whose chunked prefill is unfinished and then newly admitted requests, up to
        ``chunked_prefill_size`` new tokens. Its duration is
        ``prefill_base_s + Σ new_i x (c_lin + c_attn x (ctx_i + new_i/2))`` plus
        ``host_reload_s_per_token`` per host-tier hit token (reloaded, not recomputed).
        While a long prompt is prefilled chunk by chunk, nothing decodes: every running request
        stalls together. With ``prefill_decode_interval`` N > 0 (SGLang's
        ``--prefill-decode-interval``, off by default), each prefill forward is followed by N
        decode steps before the next prefill, while at least ``prefill_decode_interval_min_bs``
        requests (and at least one) decode (SGLang's ``Scheduler._should_defer_prefill``).
Rule 2 (admission): a waiting request is admitted when a slot is free
        (``max_running_requests``) and the cache can hold all of it (prompt + output,
        ``PrefixCache.try_lock``). Admission follows the queue's order with head-of-line blocking.
        The order is arrival (``schedule_policy`` ``fcfs``, SGLang's default) or, re-sorted
        (stably) each time a prefill forward is formed, as SGLang's cache-aware policies: ``lpm``
        longest cached prefix first (arrival order with more than 128 waiting, SGLang's
        ``WAITING_QUEUE_PREFIX_MATCH_MAX``), ``shortest-prefill-first`` fewest uncached tokens
        first (SGLang's in-batch prefix de-prioritisation is not modelled).
        A request larger than the whole KV pool or the context window is refused at submit.
Rule 3 (decode segments, closed form): otherwise every prefilled request decodes together.
        With B requests of total context C (model tokens), step k (0-based) takes
        ``s_k = decode_base_s + decode_per_req_s x B + kv_read x (C + k x B x accept)``, so
        the end of step k is quadratic in k and both "when does request i finish" and "how many
        steps are done at time t" are solved in O(1). A *segment* lasts until the first request
        finishes; an arrival that could be admitted cuts it at the next step boundary; an abort
        cuts it likewise. Work per request is O(batch size) overall, never O(output tokens).
Rule 4 (tokens): the last prefill chunk yields the first token (one model token: ``1 / token_unit``
        emulated tokens; the stream shows one emulated token from then on); each decode step yields
        ``spec_accept_length / token_unit`` emulated tokens per request (fractional carry).
Rule 5 (token_unit): one emulated token stands for ``token_unit`` model tokens; costs are
        computed in model tokens, capacities are reported in emulated tokens.
Rule 6 (a waiting request's prefix stays recent): a request holds no lock while it waits, so
        its cached prefix could be evicted for the requests admitted before it. SGLang 0.5.23
        stamps it as used instead (``SchedulePolicy._touch_waiting_prefixes``,
        ``SGLANG_ENABLE_WAITING_PREFIX_REFRESH`` on by default): under ``fcfs`` every 32nd
        admission round that has a queue touches the first 128 waiting prefixes, tail first, so the
        head is the most recent; the cache-aware orders touch each waiting prefix as they match it,
        every round. An admission round here is each time the engine forms its next operation with
        a queue and a free slot (SGLang's rounds while a full KV pool blocks the queue do not
        reach that code either).
Rule 7 (the queued work it reports): ``pending_prefill_tokens`` is SGLang 0.5.23's
        ``num_waiting_uncached_tokens`` (``LoadInquirer.get_num_waiting_uncached_tokens``): the
        uncached rest of the prompt being prefilled (its chunked request) plus, for each waiting
        request, its uncached part where the order matched prefixes (the cache-aware orders, up
        to 128 waiting), else its whole prompt times the miss rate of the prefills of the last
        15 s (``SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS``; the window ages only when a prefill is
        added, as SGLang's does). Under ``fcfs``, SGLang's default, a queued cold prompt thus
        counts at the engine's recent miss rate, not whole.

Events come out of :meth:`ReplicaEngine.advance` in time order; :meth:`ReplicaEngine.submit`
and :meth:`ReplicaEngine.abort` first catch up to ``now`` and keep the events they produce
for the next ``advance``.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from replica.emulator.cache import Lease, PrefixCache
from replica.emulator.profiles import Profile

__all__ = [
    "EngineEvent",
    "EngineLoad",
    "EngineRequest",
    "Finished",
    "FirstToken",
    "Progress",
    "ReplicaEngine",
    "Started",
    "Tokens",
    "alone_ttft_s",
    "decode_step_time",
    "prefill_time",
]


def prefill_time(profile: Profile, new_tokens: int, ctx_tokens: int) -> float:
    """Seconds to prefill ``new_tokens`` on top of ``ctx_tokens`` cached ones (model tokens),
    excluding the per-forward base cost."""
    return new_tokens * (profile.prefill_c_lin_s + profile.prefill_c_attn_s * (ctx_tokens + new_tokens / 2))


def alone_ttft_s(profile: Profile, prompt_tokens: int, cached_tokens: int) -> float:
    """Seconds to the first token of a prompt of ``prompt_tokens`` (model tokens) with its first
    ``cached_tokens`` in HBM, on an idle replica: the engine's chunked prefill forwards (rule 1)
    with nothing queued ahead and nothing sharing them. A lower bound on that request's TTFT
    anywhere with that much cached (host-tier reloads, queueing and batching only add)."""
    u = profile.token_unit
    prompt = max(1, -(-prompt_tokens // u))
    done = min(max(0, cached_tokens) // u, prompt - 1)  # the last token is always computed (rule 2)
    budget = max(1, profile.chunked_prefill_size // u)
    t = 0.0
    while done < prompt:
        n = min(budget, prompt - done)
        t += profile.prefill_base_s + prefill_time(profile, n * u, done * u)
        done += n
    return t


def decode_step_time(profile: Profile, batch: int, total_ctx_tokens: int) -> float:
    """Seconds for one decode step of ``batch`` requests with ``total_ctx_tokens`` of KV (model tokens)."""
    return (
        profile.decode_base_s
        + profile.decode_per_req_s * batch
        + profile.decode_kv_read_s_per_token * total_ctx_tokens
    )


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine sees it. Tokens are emulated tokens.

    block_hashes: chained hashes of the prompt's full ``page_size`` blocks.
    extra_hashes: hashes of further blocks of prompt+output, cached when it finishes normally.
    owner: passed to the cache's listener with the blocks this request stores (``cache`` Rule 6).
    """

    rid: str
    prompt_tokens: int
    block_hashes: Sequence[int]
    output_tokens: int
    extra_hashes: Sequence[int] = ()
    owner: object = None


@dataclass(frozen=True, slots=True)
class Started:
    rid: str
    t: float
    cached_device: int
    cached_host: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    rid: str
    t: float


@dataclass(frozen=True, slots=True)
class Tokens:
    rid: str
    n: int  # tokens generated so far
    t: float


@dataclass(frozen=True, slots=True)
class Finished:
    rid: str
    t: float
    completion_tokens: int
    reason: str  # "length" | "abort"


EngineEvent = Started | FirstToken | Tokens | Finished


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    queued: int
    used_tokens: int
    capacity_tokens: int
    token_usage: float
    evictable_tokens: int
    host_used_tokens: int
    host_total_tokens: int
    cache_hit_rate: float
    gen_throughput: float
    spec_accept_length: float
    waiting_tokens: int
    decode_sum_seq_lens: int
    pending_prefill_tokens: int = 0  # prefill work not yet done (``ReplicaEngine.pending_prefill_tokens``)


@dataclass(frozen=True, slots=True)
class Progress:
    tokens: int  # generated so far (emulated)
    next_time: float | None  # when the count next changes, if known
    finished: bool


_WAITING, _PREFILL, _DECODE, _DONE = 0, 1, 2, 3


class _Req:
    __slots__ = ("abort_pending", "cached", "gen", "lease", "prefilled", "reload", "req", "state")

    def __init__(self, req: EngineRequest) -> None:
        self.req = req
        self.state = _WAITING
        self.lease: Lease | None = None
        self.cached = 0
        self.reload = 0  # host tokens still to reload (charged on the first chunk)
        self.prefilled = 0
        self.gen = 0.0
        self.abort_pending = False


class _Prefill:
    __slots__ = ("end", "items")

    def __init__(self, end: float, items: list[tuple[_Req, int]]) -> None:
        self.end = end
        self.items = items


class _Decode:
    __slots__ = ("delta", "end", "k_end", "reqs", "s0", "step_tokens", "t0")

    def __init__(self, t0: float, s0: float, delta: float, step_tokens: float, reqs: list[_Req], k_end: int) -> None:
        self.t0 = t0
        self.s0 = s0
        self.delta = delta
        self.step_tokens = step_tokens
        self.reqs = reqs
        self.k_end = k_end
        self.end = self.time_of(k_end)

    def time_of(self, k: int) -> float:
        return self.t0 + k * self.s0 + self.delta * k * (k - 1) / 2

    def steps_by(self, t: float) -> int:
        """Number of whole steps finished at time ``t`` (capped at ``k_end``)."""
        dt = t - self.t0
        if dt <= 0:
            return 0
        if self.delta > 0:
            b = self.s0 - self.delta / 2
            k = int((-b + math.sqrt(b * b + 2 * self.delta * dt)) / self.delta)
        else:
            k = int(dt / self.s0)
        while k > 0 and self.time_of(k) > t:
            k -= 1
        while k < self.k_end and self.time_of(k + 1) <= t:
            k += 1
        return min(k, self.k_end)

    def cut(self, t: float) -> None:
        """End the segment at the first step boundary at or after ``t``."""
        k = self.steps_by(t)
        if self.time_of(k) < t:
            k += 1
        if k < self.k_end:
            self.k_end = k
            self.end = self.time_of(k)


_PREFIX_MATCH_MAX = 128  # SGLang's WAITING_QUEUE_PREFIX_MATCH_MAX
_HIT_WINDOW_S = 15.0  # SGLang's SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS default (rule 7)
_REFRESH_INTERVAL = 32  # SGLang's WAITING_PREFIX_REFRESH_INTERVAL


class ReplicaEngine:
    def __init__(self, profile: Profile, cache: PrefixCache | None = None, token_events: bool = False) -> None:
        self.profile = profile
        self.cache = cache or PrefixCache(
            profile.capacity_tokens, profile.page_size, profile.host_tokens,
            evict_whole_nodes=profile.evict_whole_nodes,
        )
        self._token_events = token_events
        self._unit = profile.token_unit
        self._step_tokens = profile.spec_accept_length / profile.token_unit
        self._budget = max(1, profile.chunked_prefill_size // profile.token_unit)
        self._reqs: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._refresh_calls = 0  # admission rounds with a queue, for the waiting prefixes' refresh
        self._prefilling: list[_Req] = []
        self._decoding: list[_Req] = []
        self._op: _Prefill | _Decode | None = None
        self._defer = 0  # decode steps owed before the next prefill (Rule 1's interval)
        self._t = 0.0
        self._events: list[EngineEvent] = []
        self._hit_rate = 0.0
        self._hit_window: deque[tuple[float, int, int]] = deque()  # (t, hit, prompt tokens): rule 7
        self._window_hits = 0
        self._window_inputs = 0
        self._gen_throughput = 0.0
        self.finished_count = 0

    # ---- public API ----------------------------------------------------------------------
    def submit(self, req: EngineRequest, now: float) -> None:
        """Queue a request at time ``now``. Raises ``ValueError`` if it can never run here."""
        if req.rid in self._reqs:
            raise ValueError(f"duplicate request id {req.rid!r}")
        total = req.prompt_tokens + req.output_tokens
        if req.prompt_tokens <= 0 or req.output_tokens < 0:
            raise ValueError("prompt must have at least one token and output_tokens must be >= 0")
        if total > self.cache.capacity_tokens:
            raise ValueError(
                f"request needs {total} KV tokens but the pool holds {self.cache.capacity_tokens}"
            )
        self._catch_up(now)
        r = _Req(req)
        self._reqs[req.rid] = r
        self._waiting.append(r)
        op = self._op
        if op is None:
            self._t = max(self._t, now)
            self._schedule(self._t)
        elif isinstance(op, _Decode) and not self._defer and self._running() < self.profile.max_running_requests:
            op.cut(now)  # (while decode steps are owed, no prefill could start anyway)

    def abort(self, rid: str, now: float) -> bool:
        """Abort a request (client went away). Frees its slot and KV. False if unknown or done."""
        self._catch_up(now)
        r = self._reqs.get(rid)
        if r is None or r.state == _DONE or r.abort_pending:
            return False
        if r.state == _WAITING:
            self._waiting.remove(r)
            self._finish(r, now, "abort")
        elif r.state == _PREFILL:
            self._prefilling.remove(r)
            self._finish(r, now, "abort")  # a running prefill op skips it when it completes
            if self._op is None:
                self._schedule(now)
        else:  # decoding: leaves at the next step boundary
            r.abort_pending = True
            self._events.append(Finished(rid, now, self._visible(r), "abort"))
            if isinstance(self._op, _Decode):
                self._op.cut(now)
        return True

    def next_event_time(self) -> float | None:
        return self._op.end if self._op is not None else None

    def advance(self, now: float) -> list[EngineEvent]:
        self._catch_up(now)
        out, self._events = self._events, []
        return out

    def progress(self, rid: str, now: float) -> Progress:
        """Tokens generated by ``rid`` at ``now`` and when that next changes (for streaming)."""
        r = self._reqs.get(rid)
        if r is None:
            return Progress(0, None, True)
        if r.state == _DONE:
            return Progress(int(r.gen + 1e-9), None, True)
        op = self._op
        if r.state != _DECODE:
            return Progress(0, op.end if op is not None else None, False)
        if isinstance(op, _Decode) and r in op.reqs:
            k = op.steps_by(now)
            tokens = min(r.req.output_tokens, int(r.gen + k * op.step_tokens + 1e-9))
            nxt = op.time_of(k + 1) if k < op.k_end else op.end
            return Progress(tokens, nxt, False)
        return Progress(self._visible(r), op.end if op is not None else None, False)

    def load(self) -> EngineLoad:
        c = self.cache
        return EngineLoad(
            running=self._running(),
            queued=len(self._waiting),
            used_tokens=c.used_tokens,
            capacity_tokens=c.capacity_tokens,
            token_usage=self.token_usage,
            evictable_tokens=c.evictable_tokens,
            host_used_tokens=c.host_used_tokens,
            host_total_tokens=c.host_capacity_tokens,
            cache_hit_rate=self._hit_rate,
            gen_throughput=self._gen_throughput,
            spec_accept_length=self.profile.spec_accept_length,
            waiting_tokens=sum(r.req.prompt_tokens for r in self._waiting),
            decode_sum_seq_lens=sum(r.req.prompt_tokens + int(r.gen) for r in self._decoding),
            pending_prefill_tokens=self.pending_prefill_tokens,
        )

    # the few figures of ``load`` that cost nothing (a fleet simulator reads them every scrape for
    # every replica; ``load``'s two sums walk the queue and the batch)
    @property
    def running(self) -> int:
        return self._running()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def pending_prefill_tokens(self) -> int:
        """Prefill work a new request would wait behind, as SGLang reports it in
        ``num_waiting_uncached_tokens`` (rule 7): the uncached rest of the prompts being prefilled,
        plus each queued prompt's uncached part, or under ``fcfs`` its whole prompt at the recent
        miss rate."""
        ahead = sum(r.req.prompt_tokens - r.prefilled for r in self._prefilling)
        if not self._waiting:
            return ahead
        if self.profile.schedule_policy == "fcfs" or len(self._waiting) > _PREFIX_MATCH_MAX:
            miss = 1.0 - (self._window_hits / self._window_inputs if self._window_inputs else 0.0)
            return ahead + sum(int(r.req.prompt_tokens * miss) for r in self._waiting)
        page = self.cache.page_size
        for r in self._waiting:
            hashes = r.req.block_hashes
            matched = self.cache.match(hashes[: min(len(hashes), (r.req.prompt_tokens - 1) // page)]).tokens
            ahead += max(0, r.req.prompt_tokens - matched)
        return ahead

    @property
    def token_usage(self) -> float:
        c = self.cache
        return c.used_tokens / c.capacity_tokens if c.capacity_tokens else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self._hit_rate

    @property
    def gen_throughput(self) -> float:
        return self._gen_throughput

    @property
    def idle(self) -> bool:
        return self._op is None and not self._waiting

    def forget(self, rid: str) -> None:
        """Drop bookkeeping of a finished request (the live server calls this when done)."""
        r = self._reqs.get(rid)
        if r is not None and r.state == _DONE:
            del self._reqs[rid]

    # ---- internals -----------------------------------------------------------------------
    def _running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    def _visible(self, r: _Req) -> int:
        # the first token counts whole from the moment it exists (the stream shows it)
        return min(r.req.output_tokens, max(int(r.gen + 1e-9), 1 if r.gen > 0 else 0))

    def _catch_up(self, now: float) -> None:
        while self._op is not None and self._op.end <= now:
            op = self._op
            self._op = None
            self._t = op.end
            if isinstance(op, _Prefill):
                self._complete_prefill(op)
            else:
                self._complete_decode(op)
            self._schedule(self._t)

    def _finish(self, r: _Req, t: float, reason: str) -> None:
        r.state = _DONE
        if r.lease is not None:
            self.cache.release(r.lease, r.req.extra_hashes if reason == "length" else ())
        if reason != "abort":
            self.finished_count += 1
        self._events.append(Finished(r.req.rid, t, self._visible(r), reason))

    def _admit(self, t: float) -> _Req | None:
        if not self._waiting or self._running() >= self.profile.max_running_requests:
            return None
        r = self._waiting[0]
        req = r.req
        page = self.cache.page_size
        n_match = min(len(req.block_hashes), (req.prompt_tokens - 1) // page)
        got = self.cache.try_lock(req.block_hashes[:n_match], req.prompt_tokens + req.output_tokens, req.owner)
        if got is None:
            return None
        self._waiting.popleft()
        r.lease, m = got
        r.cached = m.tokens
        r.prefilled = m.tokens
        r.reload = m.host_tokens
        r.state = _PREFILL
        self._prefilling.append(r)
        self._events.append(Started(req.rid, t, m.device_tokens, m.host_tokens))
        return r

    def _order_waiting(self) -> None:
        """Rule 2's cache-aware orders, and Rule 6: what the queue will need is kept recent."""
        policy = self.profile.schedule_policy
        page = self.cache.page_size

        def prefix(r: _Req) -> Sequence[int]:
            hashes = r.req.block_hashes
            return hashes[: min(len(hashes), (r.req.prompt_tokens - 1) // page)]

        if policy == "fcfs" or (policy == "lpm" and len(self._waiting) > _PREFIX_MATCH_MAX):
            # every 32nd round, the first 128 from the tail, so the head is the most recent
            refresh = self._refresh_calls % _REFRESH_INTERVAL == 0
            self._refresh_calls += 1
            if refresh:
                for r in reversed(list(itertools.islice(self._waiting, _PREFIX_MATCH_MAX))):
                    self.cache.touch(prefix(r))
            return
        cached = {r.req.rid: self.cache.touch(prefix(r)).tokens for r in self._waiting}  # matching stamps
        if policy == "lpm":
            order = sorted(self._waiting, key=lambda r: -cached[r.req.rid])
        else:
            order = sorted(self._waiting, key=lambda r: r.req.prompt_tokens - cached[r.req.rid])
        self._waiting = deque(order)

    def _schedule(self, t: float) -> None:
        p = self.profile
        u = self._unit
        if self._defer:
            if self._decoding and len(self._decoding) >= p.prefill_decode_interval_min_bs:
                self._start_decode(t, self._defer)
                return
            self._defer = 0
        if self._waiting and self._running() < p.max_running_requests:
            self._order_waiting()
        budget = self._budget
        items: list[tuple[_Req, int]] = []
        cost = 0.0
        hits = 0
        inputs = 0
        i = 0
        while budget > 0:
            if i < len(self._prefilling):
                r = self._prefilling[i]
                i += 1
            else:
                adm = self._admit(t)
                if adm is None:
                    break
                r = adm
                i += 1
                hits += r.cached
                inputs += r.req.prompt_tokens
            n = min(r.req.prompt_tokens - r.prefilled, budget)
            budget -= n
            cost += prefill_time(p, n * u, r.prefilled * u)
            if r.reload:
                cost += p.host_reload_s_per_token * r.reload * u
                r.reload = 0
            items.append((r, n))
        if items:
            if inputs:
                self._hit_rate = hits / inputs
                self._add_hits(t, hits, inputs)
            self._op = _Prefill(t + p.prefill_base_s + cost, items)
            return
        if self._decoding:
            self._start_decode(t)

    def _add_hits(self, t: float, hits: int, inputs: int) -> None:
        """Rule 7's window (SGLang's ``_CacheHitRateWindow``)."""
        w = self._hit_window
        w.append((t, hits, inputs))
        self._window_hits += hits
        self._window_inputs += inputs
        while w and w[0][0] <= t - _HIT_WINDOW_S:
            _, h, n = w.popleft()
            self._window_hits -= h
            self._window_inputs -= n

    def _complete_prefill(self, op: _Prefill) -> None:
        t = op.end
        self._defer = self.profile.prefill_decode_interval
        for r, n in op.items:
            if r.state != _PREFILL:
                continue  # aborted meanwhile
            r.prefilled += n
            if r.prefilled < r.req.prompt_tokens:
                continue
            self._prefilling.remove(r)
            assert r.lease is not None
            self.cache.insert(r.lease, r.req.block_hashes[r.lease.blocks :])
            if r.req.output_tokens == 0:
                self._finish(r, t, "length")
                continue
            r.gen = 1.0 / self._unit  # one model token, as the engine it stands for
            self._events.append(FirstToken(r.req.rid, t))
            if r.gen >= r.req.output_tokens - 1e-9:
                self._finish(r, t, "length")
            else:
                r.state = _DECODE
                self._decoding.append(r)

    def _start_decode(self, t: float, steps: int = 1 << 62) -> None:
        """A decode segment of every decoding request, of at most ``steps`` steps."""
        p = self.profile
        u = self._unit
        reqs = list(self._decoding)
        b = len(reqs)
        a = self._step_tokens
        ctx = 0.0
        k_end = steps
        for r in reqs:
            ctx += r.req.prompt_tokens + r.gen
            k_end = min(k_end, math.ceil((r.req.output_tokens - r.gen) / a - 1e-9))
        s0 = decode_step_time(p, b, int(ctx * u))
        delta = p.decode_kv_read_s_per_token * b * p.spec_accept_length
        self._gen_throughput = b * a / s0
        self._op = _Decode(t, s0, delta, a, reqs, max(k_end, 1))

    def _complete_decode(self, op: _Decode) -> None:
        t = op.end
        self._defer = max(0, self._defer - op.k_end)
        gained = op.k_end * op.step_tokens
        still: list[_Req] = []
        for r in op.reqs:
            r.gen += gained
            if r.abort_pending:  # its Finished(abort) went out at abort time; nothing else will ask
                r.state = _DONE
                if r.lease is not None:
                    self.cache.release(r.lease)
                self._reqs.pop(r.req.rid, None)
            elif r.gen >= r.req.output_tokens - 1e-9:
                r.gen = float(r.req.output_tokens)
                self._finish(r, t, "length")
            else:
                if self._token_events:
                    self._events.append(Tokens(r.req.rid, self._visible(r), t))
                still.append(r)
        self._decoding = still

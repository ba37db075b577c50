"""The emulator against the real engine (issue 21, item 3).

Wire: every key, type and metric family (with its labels) that the gateway, the sidecar or the load
driver reads is fetched from a live real SGLang and from the emulator; any difference fails, printed as a diff.

Cache: one request sequence (several sessions, growing contexts, a KV pool small enough to evict)
goes to a real server and to the emulator configured with the same capacity and page size; the
per-request ``cached_tokens`` must agree within 5 % (of the prompt) or the test fails with the table.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from loadtests.real_sglang import RealServer, flush_caches
from replica.emulator.profiles import get_profile
from replica.emulator.runner import running_emulators
from replica.emulator.server import EmulatorConfig
from router.engine_metrics import _WANTED
from tests.real_sglang.conftest import CONTEXT_TOKENS, POOL_TOKENS


def emulator_config(**changes: Any) -> EmulatorConfig:
    """The emulator set up like the ``sglang-cpu-tiny`` servers here: same pool, page size 1, no host
    tier, usage in every stream; time runs 100x faster than modelled (timing is not compared)."""
    prof = get_profile("small-test").with_overrides(
        kv_capacity_tokens=POOL_TOKENS, host_capacity_tokens=0, page_size=1, context_length=CONTEXT_TOKENS,
        max_running_requests=64, chunked_prefill_size=4096, spec_accept_length=1.0,
    )
    cfg = EmulatorConfig(profile=prof, time_scale=0.01, stream_response_default_include_usage=True)
    return dataclasses.replace(cfg, **changes)


# ---- wire ------------------------------------------------------------------------------------------

# (GET path, JSON paths the gateway or the sidecar reads; "[]" = every item of a list)
READ_JSON: dict[str, tuple[str, ...]] = {
    "/server_info": (
        "max_total_num_tokens", "internal_states[].max_total_num_tokens", "served_model_name", "model_path",
        "tp_size", "enable_hierarchical_cache", "hicache_ratio", "hicache_size", "page_size", "version",
        "status", "kv_events_config",
    ),
    "/model_info": ("served_model_name", "model_path"),
    "/v1/models": ("object", "data[].id", "data[].object"),
    "/v1/loads": (
        "loads[].num_running_reqs", "loads[].num_waiting_reqs", "loads[].num_waiting_uncached_tokens",
        "loads[].max_total_num_tokens", "loads[].token_usage", "loads[].cache_hit_rate",
    ),
}
# token counts: the readers want integers, not any number
INT_PATHS = {"max_total_num_tokens", "internal_states[].max_total_num_tokens", "tp_size", "page_size",
             "loads[].num_running_reqs", "loads[].num_waiting_reqs", "loads[].num_waiting_uncached_tokens",
             "loads[].max_total_num_tokens", "usage.prompt_tokens", "usage.completion_tokens",
             "usage.prompt_tokens_details.cached_tokens", "meta_info.prompt_tokens", "meta_info.cached_tokens",
             "meta_info.completion_tokens"}
USAGE_OPENAI = ("usage.prompt_tokens", "usage.completion_tokens", "usage.prompt_tokens_details.cached_tokens")
USAGE_NATIVE = ("meta_info.prompt_tokens", "meta_info.cached_tokens", "meta_info.completion_tokens")


def _values(doc: Any, path: str) -> Iterator[Any]:
    head, _, rest = path.partition(".")
    many = head.endswith("[]")
    key = head.removesuffix("[]")
    if not isinstance(doc, dict) or key not in doc:
        yield _MISSING
        return
    v = doc[key]
    items = (v if isinstance(v, list) else [_MISSING]) if many else [v]
    for item in items:
        if rest:
            yield from _values(item, rest)
        else:
            yield item


_MISSING = object()


def _kind(v: Any, path: str) -> str:
    if v is _MISSING:
        return "missing"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return ("int" if isinstance(v, int) else "float") if path in INT_PATHS else "number"
    return type(v).__name__


def shape(doc: Any, paths: tuple[str, ...]) -> dict[str, str]:
    return {p: "|".join(sorted({_kind(v, p) for v in _values(doc, p)})) for p in paths}


# what the load driver reads from /metrics (``loadtests.live.engine_queue_from_metrics``): the
# scheduler's histogram exists from the start, the per-request one once a request was observed (a
# server that served earlier tests has it already, a fresh one not), so it is compared after requests
QUEUE_READ = frozenset({"queue_time_seconds_bucket", "queue_time_seconds_sum", "queue_time_seconds_count"})
TTFT_READ = frozenset({"time_to_first_token_seconds_sum", "time_to_first_token_seconds_count"})


def metric_labels(text: str, extra: frozenset[str] = QUEUE_READ) -> dict[str, str]:
    """Wanted family (the gateway's, plus ``extra``) -> its sample label names (sorted, joined)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.replace(":", "_").removeprefix("sglang_")
            if name in _WANTED or name in extra:
                out.setdefault(name, set()).add(",".join(sorted(s.labels)))
    return {k: " | ".join(sorted(v)) for k, v in out.items()}


async def surface(base: str) -> dict[str, Any]:
    """What the gateway and the sidecar read from one server, as kinds (never values)."""
    got: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for path in ("/health", "/get_load", "/flush_cache"):
            method = s.post if path == "/flush_cache" else s.get
            async with method(base + path) as r:
                got[f"GET {path} status" if path != "/flush_cache" else "POST /flush_cache status"] = r.status
        for path, paths in READ_JSON.items():
            async with s.get(base + path) as r:
                got[f"{path} status"] = r.status
                doc = await r.json(content_type=None)
            for k, v in shape(doc, paths).items():
                got[f"{path} {k}"] = v
        async with s.get(base + "/metrics", headers={"Accept": "text/plain"}) as r:
            got["/metrics content-type"] = r.headers["Content-Type"].split(";")[0]
            for k, v in metric_labels(await r.text()).items():
                got[f"/metrics {k} labels"] = v
        text = "def fidelity(): return 42  # a prompt"
        for route, body in (
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 3}),
            ("/v1/completions", {"model": "m", "prompt": text, "max_tokens": 3}),
            ("/generate", {"text": text, "sampling_params": {"max_new_tokens": 3}}),
        ):
            paths = USAGE_NATIVE if route == "/generate" else USAGE_OPENAI
            for stream in (False, True):
                async with s.post(base + route, json={**body, "stream": stream}) as r:
                    got[f"POST {route} stream={stream} content-type"] = r.headers["Content-Type"].split(";")[0]
                    raw = await r.read()
                if stream:
                    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
                    got[f"POST {route} stream=True ends with [DONE]"] = events[-1] == b"[DONE]"
                    doc = json.loads(events[-2])  # the chunk the gateway learns usage from
                else:
                    doc = json.loads(raw)
                for k, v in shape(doc, paths).items():
                    got[f"POST {route} stream={stream} {k}"] = v
        # per-request histograms have a series per label set only once one was observed
        async with s.get(base + "/metrics", headers={"Accept": "text/plain"}) as r:
            for k, v in metric_labels(await r.text(), QUEUE_READ | TTFT_READ).items():
                got[f"/metrics after requests {k} labels"] = v
    return got


def wire_diff(real: dict[str, Any], emu: dict[str, Any]) -> list[str]:
    return [
        f"{k}: real {real.get(k, 'absent')!r} vs emulator {emu.get(k, 'absent')!r}"
        for k in sorted(set(real) | set(emu))
        if real.get(k, "absent") != emu.get(k, "absent")
    ]


async def test_wire_fidelity(fleet: list[RealServer]) -> None:
    real = await surface(fleet[0].url)
    async with running_emulators(1, config=emulator_config()) as (emu_rep,):
        emu = await surface(emu_rep.url)
    diff = wire_diff(real, emu)
    print(json.dumps({"wire_diff": diff, "checked": len(real)}, indent=1))
    assert real["GET /get_load status"] == 404  # SGLang 0.5.23 has no /get_load
    assert len(real) >= 50
    assert diff == [], "\n".join(diff)


# ---- limits and in-stream errors -------------------------------------------------------------------

# (route, prompt length in token ids, max tokens (None: not sent), stream, extra body fields), chosen
# around the fleet's limits: context 8192, scheduler bound max_req_len = min(8192, pool 12000) - 1 =
# 8191 and max_req_input_len = 8191 - 5 = 8186
LIMIT_CASES: list[tuple[str, int, int | None, bool, dict[str, Any]]] = [
    # no max_tokens near the context: served, the output cut to max_req_len - prompt - 1 (40)
    ("/generate", 8150, None, False, {}),
    ("/v1/chat/completions", 8150, None, False, {}),
    ("/v1/chat/completions", 8150, None, True, {}),
    # prompt + max_tokens = the context: allowed, and cut the same way (90, not 92)
    ("/v1/completions", 8100, 92, False, {}),
    # a prompt of the context length or more: refused by the tokenizer manager, even with max 0
    ("/generate", 8192, 0, False, {}),
    ("/v1/chat/completions", 8200, 1, True, {}),
    # ... which a streamed /generate reports in-stream (200, an error event, [DONE])
    ("/generate", 8200, 1, True, {}),
    ("/generate", 8100, 200, True, {}),
    # a prompt at max_req_input_len or more: refused by the scheduler (in-stream on every route)
    ("/generate", 8188, 1, False, {}),
    ("/generate", 8188, 1, True, {}),
    ("/v1/chat/completions", 8188, 1, True, {}),
    ("/v1/completions", 8188, 1, True, {}),
    # bad sampling values: the tokenizer manager again (in-stream on /generate)
    ("/generate", 10, -1, True, {}),
    ("/v1/chat/completions", 10, -1, False, {}),
    # --stream-response-default-include-usage wins over a client's include_usage false
    ("/v1/chat/completions", 10, 2, True, {"stream_options": {"include_usage": False}}),
    ("/v1/completions", 10, 2, True, {"stream_options": {"include_usage": False}}),
]


def limit_body(
    route: str, n: int, max_tokens: int | None, stream: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    ids = [10 + i % 1990 for i in range(n)]  # within the tiny model's vocabulary
    if route == "/generate":
        sp: dict[str, Any] = {"ignore_eos": True}
        if max_tokens is not None:
            sp["max_new_tokens"] = max_tokens
        return {"input_ids": ids, "sampling_params": sp, "stream": stream, **extra}
    body: dict[str, Any] = {"model": "m", "stream": stream, "ignore_eos": True, **extra}
    if route == "/v1/completions":
        body["prompt"] = ids
    else:
        body.update(input_ids=ids, messages=[{"role": "user", "content": "x"}])
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def outcome(status: int, content_type: str, raw: bytes) -> list[Any]:
    """What a client (and the gateway's usage sniffer) sees, without the sampled text, ids and times:
    the status, then the error message or the output length and finish reason; for a stream each
    event that is not plain content (errors, finishes, usage chunks, ``[DONE]``)."""
    out: list[Any] = [status, content_type.split(";")[0]]
    if not content_type.startswith("text/event-stream"):
        doc = json.loads(raw)
        if isinstance(doc.get("error"), dict):
            return [*out, "error", doc["error"].get("message")]
        if "error" in doc or doc.get("object") == "error":
            return [*out, "error", doc.get("message", doc.get("error"))]
        if "meta_info" in doc:
            m = doc["meta_info"]
            return [*out, m["completion_tokens"], m["finish_reason"]]
        return [*out, doc["usage"]["completion_tokens"], doc["choices"][0]["finish_reason"]]
    for e in raw.split(b"\n\n"):
        if not e:
            continue
        if not e.startswith(b"data: "):
            out.append(("not an SSE data line", e[:80]))
        elif e == b"data: [DONE]":
            out.append("[DONE]")
        else:
            d = json.loads(e[6:])
            if "error" in d:
                err = d["error"]
                out.append(("error", err.get("message"), err.get("code"), err.get("type")))
            elif "meta_info" in d and d["meta_info"]["finish_reason"] is not None:
                m = d["meta_info"]
                out.append(("finished", m["finish_reason"], m["prompt_tokens"], m["completion_tokens"]))
            elif d.get("usage"):
                u = d["usage"]
                out.append(("usage", u["prompt_tokens"], u["completion_tokens"]))
            elif d.get("choices") and d["choices"][0].get("finish_reason") is not None:
                out.append(("finish", d["choices"][0]["finish_reason"]))
    return out


async def run_limit_cases(base: str) -> list[list[Any]]:
    got = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for case in LIMIT_CASES:
            async with s.post(base + case[0], json=limit_body(*case)) as r:
                got.append(outcome(r.status, r.headers.get("Content-Type", ""), await r.read()))
    return got


async def test_limits_and_in_stream_errors_fidelity(fleet: list[RealServer]) -> None:
    """The context and input-length limits (which requests are served, refused, or cut short, and
    how a stream reports a refusal: status or in-stream event), bad sampling values, and the server's
    include-usage default: the same outcome from the emulator as from the real engine."""
    real = await run_limit_cases(fleet[0].url)
    async with running_emulators(1, config=emulator_config()) as (emu_rep,):
        emu = await run_limit_cases(emu_rep.url)
    rows = [
        {"case": f"{c[0]} n={c[1]} max={c[2]} stream={c[3]} {c[4] or ''}", "real": r, "emulator": e}
        for c, r, e in zip(LIMIT_CASES, real, emu, strict=True)
    ]
    print(json.dumps(rows, indent=1, default=str))
    # the real engine behaves as the cases say (guards against a fleet set up otherwise)
    assert real[0][2:] == [40, {"type": "length", "length": 40}], real[0]
    assert real[6][:2] == [200, "text/event-stream"] and real[6][2][0] == "error", real[6]
    bad = [row for row in rows if row["real"] != row["emulator"]]
    assert not bad, json.dumps(bad, indent=1, default=str)


# ---- client errors and odd requests ----------------------------------------------------------------

_MSGS = [{"role": "user", "content": "hello there"}]
# greedy and ignore_eos: the real model's dummy weights sample an EOS id now and then, which ends a served
# case with "stop" where the emulator says "length" (CI failed on "text-parts" so, once)
_CHAT = {"model": "m", "messages": _MSGS, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
_COMP = {"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
_GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}

# (case id, method, path, body: dict/list/str is sent as JSON, bytes as is with a JSON content type,
# None: no body). Left out on purpose: a JSON array or string sent to /v1/chat/completions (SGLang
# 0.5.23 crashes, 500 text/plain or a reset connection; the gateway refuses such bodies before they
# reach an engine, the emulator answers 400 like the other routes), ``n`` > 1 and ``logprobs`` (not
# emulated: 400 and null; nothing the gateway reads).
CLIENT_CASES: list[tuple[str, str, str, Any]] = [
    ("bad-json-chat", "POST", "/v1/chat/completions", b"{not json"),
    ("bad-json-completions", "POST", "/v1/completions", b"{not json"),
    ("bad-json-generate", "POST", "/generate", b"{not json"),
    ("string-body-completions", "POST", "/v1/completions", "hi"),
    ("array-body-generate", "POST", "/generate", [1, 2]),
    ("no-messages", "POST", "/v1/chat/completions", {"model": "m", "max_tokens": 2}),
    ("no-prompt", "POST", "/v1/completions", {"model": "m", "max_tokens": 2}),
    ("empty-messages", "POST", "/v1/chat/completions", {**_CHAT, "messages": []}),
    ("text-parts", "POST", "/v1/chat/completions",
     {**_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ("unknown-role", "POST", "/v1/chat/completions", {**_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}),
    ("max-tokens-0-chat", "POST", "/v1/chat/completions", {**_CHAT, "max_tokens": 0}),
    ("max-tokens-neg-chat", "POST", "/v1/chat/completions", {**_CHAT, "max_tokens": -1}),
    ("max-tokens-0-completions", "POST", "/v1/completions", {**_COMP, "max_tokens": 0}),
    ("max-tokens-neg-completions", "POST", "/v1/completions", {**_COMP, "max_tokens": -1}),
    ("max-tokens-string-chat", "POST", "/v1/chat/completions", {**_CHAT, "max_tokens": "2"}),
    ("temperature-neg-chat", "POST", "/v1/chat/completions", {**_CHAT, "temperature": -1}),
    ("temperature-neg-completions-stream", "POST", "/v1/completions", {**_COMP, "temperature": -1, "stream": True}),
    ("top-p-2-chat", "POST", "/v1/chat/completions", {**_CHAT, "top_p": 2}),
    ("top-p-2-generate", "POST", "/generate", {**_GEN, "sampling_params": {"max_new_tokens": 2, "top_p": 2}}),
    ("top-p-2-generate-stream", "POST", "/generate",
     {**_GEN, "sampling_params": {"max_new_tokens": 2, "top_p": 2}, "stream": True}),
    ("stop-chat", "POST", "/v1/chat/completions", {**_CHAT, "stop": ["zzzq", "\n\n"]}),
    ("stop-completions-stream", "POST", "/v1/completions", {**_COMP, "stop": "zzzq", "stream": True}),
    ("unknown-model-chat", "POST", "/v1/chat/completions", {**_CHAT, "model": "no-such-model"}),
    ("unknown-model-completions", "POST", "/v1/completions", {**_COMP, "model": "no-such-model"}),
    ("unknown-route", "POST", "/v1/nope", {"a": 1}),
    ("unknown-route-get", "GET", "/nope", None),
    ("get-chat", "GET", "/v1/chat/completions", None),
    ("get-generate", "GET", "/generate", None),
    ("generate-input-ids", "POST", "/generate", {"input_ids": [11, 12, 13], "sampling_params": _GEN["sampling_params"]}),
    ("generate-text-and-ids", "POST", "/generate", {**_GEN, "input_ids": [11, 12]}),
    ("stream-yes-chat", "POST", "/v1/chat/completions", {**_CHAT, "stream": "yes"}),
    ("stream-yes-generate", "POST", "/generate", {**_GEN, "stream": "yes"}),
]
# values, not just types, for these keys (the error's kind, the finish reason); meta_info is compared on
# what readers take from it (the rest are per-request timings)
_VALUE_KEYS = frozenset({"object", "type", "code", "param", "finish_reason"})
_META_READ = frozenset({"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"})


def _shape(v: Any, key: str = "") -> Any:
    if isinstance(v, dict):
        keep = _META_READ if key == "meta_info" else v.keys()
        return {k: _shape(x, k) for k, x in sorted(v.items()) if k in keep}
    if isinstance(v, list):  # the distinct item shapes, in order
        items = [json.dumps(_shape(x), sort_keys=True) for x in v]
        return [json.loads(i) for i in dict.fromkeys(items)]
    if key in _VALUE_KEYS:
        return f"={v!r}"
    return "null" if v is None else type(v).__name__


async def client_outcome(base: str, method: str, path: str, body: Any) -> dict[str, Any]:
    """Status, content type and the body's shape (a stream: its distinct event shapes in order)."""
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"data": body, "headers": {"Content-Type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s,
        s.request(method, base + path, **kw) as r,
    ):
        raw = await r.read()
        ct = r.headers.get("Content-Type", "").split(";")[0]
    out: dict[str, Any] = {"status": r.status, "content-type": ct}
    if ct == "text/event-stream":
        events: list[Any] = []
        for e in raw.split(b"\n\n"):
            if e:
                sh = e.decode() if not e.startswith(b"data: {") else _shape(json.loads(e[6:]))
                if not events or events[-1] != sh:
                    events.append(sh)
        out["events"] = events
    else:
        try:
            out["body"] = _shape(json.loads(raw))
        except ValueError:
            out["body"] = raw.decode(errors="replace")
    return out


@pytest.mark.parametrize(("method", "path", "body"), [c[1:] for c in CLIENT_CASES], ids=[c[0] for c in CLIENT_CASES])
async def test_client_error_fidelity(fleet: list[RealServer], method: str, path: str, body: Any) -> None:
    """Requests a client may get wrong (bad JSON, missing or mistyped fields, bad sampling values,
    unknown roles, routes and methods) and odd ones that are served: the status, content type and
    body shape (error keys and their ``object``/``type``/``code``) match the real engine's, since the
    gateway relays them to the user unchanged."""
    real = await client_outcome(fleet[0].url, method, path, body)
    async with running_emulators(1, config=emulator_config()) as (emu_rep,):
        emu = await client_outcome(emu_rep.url, method, path, body)
    if real != emu:
        diff = difflib.unified_diff(
            json.dumps(real, indent=1).splitlines(), json.dumps(emu, indent=1).splitlines(),
            "real SGLang", "emulator", lineterm="",
        )
        pytest.fail("\n".join(diff))


# ---- n choices and logprobs ------------------------------------------------------------------------

# token ids, not text: the two tokenizers differ and the usage is compared exactly
_NIDS = [10 + i for i in range(24)]
_NC: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}], "input_ids": _NIDS, "max_tokens": 3,
       "ignore_eos": True}
_NP: dict[str, Any] = {"model": "m", "prompt": _NIDS, "max_tokens": 3, "ignore_eos": True}
_NG: dict[str, Any] = {"input_ids": _NIDS, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}

# (case id, path, body); the fleet includes usage in every stream. ``n`` 0 and negative are what SGLang
# 0.5.23 does with them (a zero step in its usage sums; a negative one counts no prompt unstreamed).
# Streamed logprobs are greedy: SGLang holds back the text of a token that ends inside a UTF-8
# character and drops that token's logprob entry from the stream (6 of 60 sampled streams of the
# tiny model here, none of 60 greedy ones). The emulator does not model that.
N_LOGPROB_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat-n2", "/v1/chat/completions", {**_NC, "n": 2}),
    ("chat-n3-greedy", "/v1/chat/completions", {**_NC, "n": 3, "temperature": 0}),
    ("chat-n2-stream", "/v1/chat/completions", {**_NC, "n": 2, "stream": True}),
    ("chat-n2-meta-top-without-logprobs", "/v1/chat/completions",
     {**_NC, "n": 2, "return_meta_info": True, "top_logprobs": 2}),
    ("chat-n0", "/v1/chat/completions", {**_NC, "n": 0}),
    ("chat-n-neg", "/v1/chat/completions", {**_NC, "n": -1}),
    ("chat-n-neg-stream", "/v1/chat/completions", {**_NC, "n": -1, "stream": True}),
    ("chat-logprobs-top0", "/v1/chat/completions", {**_NC, "logprobs": True, "top_logprobs": 0}),
    ("chat-logprobs-top2", "/v1/chat/completions", {**_NC, "logprobs": True, "top_logprobs": 2}),
    ("chat-logprobs-top21", "/v1/chat/completions", {**_NC, "logprobs": True, "top_logprobs": 21}),
    ("chat-logprobs-top2-stream", "/v1/chat/completions",
     {**_NC, "logprobs": True, "top_logprobs": 2, "stream": True, "temperature": 0}),
    ("chat-logprobs-n2", "/v1/chat/completions", {**_NC, "logprobs": True, "top_logprobs": 1, "n": 2}),
    ("completions-n2", "/v1/completions", {**_NP, "n": 2}),
    ("completions-n2-stream", "/v1/completions", {**_NP, "n": 2, "stream": True}),
    ("completions-n0-stream", "/v1/completions", {**_NP, "n": 0, "stream": True}),
    ("completions-n-neg", "/v1/completions", {**_NP, "n": -1}),
    ("completions-logprobs0", "/v1/completions", {**_NP, "logprobs": 0}),
    ("completions-logprobs2", "/v1/completions", {**_NP, "logprobs": 2}),
    ("completions-logprobs2-stream", "/v1/completions", {**_NP, "logprobs": 2, "stream": True, "temperature": 0}),
    ("completions-logprobs1-n2", "/v1/completions", {**_NP, "logprobs": 1, "n": 2}),
    ("generate-logprob-top2", "/generate", {**_NG, "return_logprob": True, "top_logprobs_num": 2}),
    ("generate-logprob-stream", "/generate", {**_NG, "return_logprob": True, "stream": True}),
    ("generate-n2", "/generate", {**_NG, "sampling_params": {**_NG["sampling_params"], "n": 2}}),
    ("generate-n2-stream", "/generate", {**_NG, "sampling_params": {**_NG["sampling_params"], "n": 2}, "stream": True}),
]
_LOGPROB_META = frozenset({"input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
                           "input_top_logprobs", "output_top_logprobs"})


def _n_shape(v: Any, key: str = "") -> Any:
    """``_shape``, but ``meta_info`` also keeps its logprob fields, and a completions
    ``top_logprobs`` entry (a dict keyed by token text) becomes one ``<token>`` key."""
    if isinstance(v, dict):
        if key == "meta_info":
            v = {k: x for k, x in v.items() if k in _META_READ | _LOGPROB_META}
        return {k: _n_shape(x, k) for k, x in sorted(v.items())}
    if isinstance(v, list):
        if key == "top_logprobs":
            v = [{"<token>": next(iter(x.values()))} if isinstance(x, dict) and x and "token" not in x else x for x in v]
        items = [json.dumps(_n_shape(x, key if key in ("top_logprobs",) else ""), sort_keys=True) for x in v]
        return [json.loads(i) for i in dict.fromkeys(items)]
    if key in _VALUE_KEYS:
        return f"={v!r}"
    return "null" if v is None else type(v).__name__


def _n_facts(doc: Any, facts: dict[str, Any]) -> None:
    """The model-independent values: choice indices, finishes per choice, token counts, list sizes."""
    if isinstance(doc, list):
        facts.setdefault("list lengths", []).append(len(doc))
        for d in doc:
            _n_facts(d, facts)
        return
    if not isinstance(doc, dict):
        return
    if "index" in doc and "meta_info" in doc:
        facts.setdefault("generate chunk indices", set()).add(doc["index"])
    if isinstance(doc.get("meta_info"), dict):
        m = doc["meta_info"]
        if m.get("finish_reason") is not None:
            facts.setdefault("generate finished", []).append(
                (m["prompt_tokens"], m["completion_tokens"], m["cached_tokens"], m.get("output_token_logprobs_length")))
    for c in doc.get("choices") or []:
        facts.setdefault("choice indices", set()).add(c.get("index"))
        if c.get("finish_reason") is not None:
            facts.setdefault("finishes", []).append(c["index"])
        lp = c.get("logprobs")
        if isinstance(lp, dict):
            tops = [len(t["top_logprobs"]) for t in lp.get("content", [])] or [len(t) for t in lp.get("top_logprobs", [])]
            facts.setdefault("logprob tokens per choice", {}).setdefault(c["index"], 0)
            facts["logprob tokens per choice"][c["index"]] += len(lp.get("content") or lp.get("tokens") or [])
            facts.setdefault("top logprobs sizes", set()).update(tops)
    if isinstance(doc.get("usage"), dict):
        u = doc["usage"]
        d = u.get("prompt_tokens_details") or {}
        facts["usage"] = (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"], d.get("cached_tokens"))
    if "id" in doc:
        facts.setdefault("ids", set()).add(doc["id"])


async def n_outcome(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Status, content type, the shape (a stream: its distinct event shapes in order) and the facts
    (``_n_facts``; ids only counted: one per sequence in a stream)."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s,
        s.post(base + path, json=body) as r,
    ):
        raw = await r.read()
        ct = r.headers.get("Content-Type", "").split(";")[0]
    out: dict[str, Any] = {"status": r.status, "content-type": ct}
    facts: dict[str, Any] = {}
    if ct == "text/event-stream":
        # the choices' chunks interleave as the sequences happen to run: each choice's own events
        # (and the rest: usage, errors, [DONE]) are compared in order, not the interleaving
        events: dict[str, list[Any]] = {}
        finished = False
        for e in raw.split(b"\n\n"):
            if not e:
                continue
            key = "other"
            if e.startswith(b"data: {"):
                d = json.loads(e[6:])
                _n_facts(d, facts)
                sh = _n_shape(d)
                choices = d.get("choices") or []
                idx = d.get("index", choices[0].get("index") if len(choices) == 1 else None)
                key = "other" if idx is None else f"choice {idx}"
                delta = choices[0].get("delta") if len(choices) == 1 else None
                if isinstance(delta, dict):  # chat: every finish chunk comes after all content
                    if delta.get("content") is not None and finished:
                        facts["chat content after a finish chunk"] = True
                    finished = finished or choices[0].get("finish_reason") is not None
            else:
                sh = e.decode()
            seq = events.setdefault(key, [])
            if not seq or seq[-1] != sh:
                seq.append(sh)
        out["events"] = events
    else:
        doc = json.loads(raw)
        _n_facts(doc, facts)
        out["body"] = _n_shape(doc)
    if "finishes" in facts:
        facts["finishes"] = sorted(facts["finishes"])
    facts["ids"] = len(facts.get("ids", ()))
    out["facts"] = {k: sorted(v) if isinstance(v, set) else v for k, v in facts.items()}
    return out


@pytest.mark.parametrize(("path", "body"), [c[1:] for c in N_LOGPROB_CASES], ids=[c[0] for c in N_LOGPROB_CASES])
async def test_n_and_logprobs_fidelity(fleet: list[RealServer], path: str, body: dict[str, Any]) -> None:
    """``n`` choices and logprobs on every route, streamed and not: status, content type, the shape
    of every body or event (logprob entries included; their values and the text are the model's,
    compared by type), the choice indices and finishes, the usage (prompt and cached tokens once per
    prompt, completion tokens summed) and the number of sequence ids."""
    real = await n_outcome(fleet[0].url, path, body)
    async with running_emulators(1, config=emulator_config()) as (emu_rep,):
        emu = await n_outcome(emu_rep.url, path, body)
    if real != emu:
        diff = difflib.unified_diff(
            json.dumps(real, indent=1, default=str).splitlines(), json.dumps(emu, indent=1, default=str).splitlines(),
            "real SGLang", "emulator", lineterm="",
        )
        pytest.fail("\n".join(diff))


# ---- cache -----------------------------------------------------------------------------------------


def cache_sequence(seed: int = 21) -> list[tuple[str, list[int]]]:
    """Sessions with growing contexts, interleaved: each turn's input is the session's last input
    plus the turn's new tokens (ids < 2048, the tiny model's vocabulary). Sized so that the sessions
    together outgrow the pool (``POOL_TOKENS``) and the oldest are evicted."""
    rng = random.Random(seed)
    sessions = {f"s{i}": [rng.randrange(10, 2000) for _ in range(rng.randrange(500, 1500))] for i in range(6)}
    seq: list[tuple[str, list[int]]] = []
    for turn in range(6):
        order = list(sessions)
        rng.shuffle(order)
        for sid in order:
            if turn:
                sessions[sid] = sessions[sid] + [rng.randrange(10, 2000) for _ in range(rng.randrange(200, 700))]
            seq.append((sid, list(sessions[sid])))
    return seq


async def run_sequence(base: str, seq: list[tuple[str, list[int]]]) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) per request, one request at a time, one output token each."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for _, ids in seq:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            async with s.post(base + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                meta = (await r.json())["meta_info"]
            out.append((meta["prompt_tokens"], meta["cached_tokens"]))
    return out


def cache_table(
    seq: list[tuple[str, list[int]]], real: list[tuple[int, int]], emu: list[tuple[int, int]]
) -> list[dict[str, Any]]:
    rows = []
    for i, ((sid, _), (p_real, c_real), (p_emu, c_emu)) in enumerate(zip(seq, real, emu, strict=True)):
        rows.append({"i": i, "session": sid, "prompt": p_real, "prompt_emu": p_emu, "cached_real": c_real,
                     "cached_emu": c_emu, "diff_pct": round(100.0 * abs(c_real - c_emu) / p_real, 2)})
    return rows


async def test_cache_fidelity(fleet: list[RealServer]) -> None:
    seq = cache_sequence()
    assert sum(len(ids) for _, ids in seq[-6:]) > POOL_TOKENS  # the last turns cannot all fit: evictions
    flush_caches([fleet[0].url])
    real = await run_sequence(fleet[0].url, seq)
    async with running_emulators(1, config=emulator_config()) as (emu_rep,):
        emu = await run_sequence(emu_rep.url, seq)
    rows = cache_table(seq, real, emu)
    print(json.dumps({"cache_table": rows}))
    assert any(r["cached_real"] < 0.5 * r["prompt"] and r["i"] >= 5 for r in rows)  # real evictions happened
    assert sum(r["cached_real"] for r in rows) > 0
    bad = [r for r in rows if r["diff_pct"] > 5.0 or r["prompt"] != r["prompt_emu"]]
    assert not bad, json.dumps(bad, indent=1)



"""The emulator's scheduler (``replica.emulator.timemodel`` Rule 1) against a real SGLang 0.5.23: while
a long prompt is prefilled chunk by chunk, the running requests generate nothing until its last
chunk (SGLang runs a prefill whenever one can run); with ``--prefill-decode-interval N`` each chunk
is followed by N decode rounds, but only while at least ``--prefill-decode-interval-min-bs``
requests decode. The same calls go to the real engine (``INTERVAL_SETS``) and to the emulator with
the same chunk size, interval and minimum; the counts of tokens the decoding requests get while
the long prompt is prefilled must follow the rule on both (timing is each server's own)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import aiohttp

from loadtests.real_sglang import RealServer
from replica.emulator.runner import running_emulators
from tests.real_sglang.conftest import CHUNK_TOKENS, INTERVAL, INTERVAL_MIN_BS
from tests.real_sglang.test_emulator_fidelity import emulator_config

# ~2,500 tokens: several chunks, well inside the pool; each probe's own (a cached one would not prefill)
LONG_WORDS = " ".join(f"w{i}" for i in range(700))


async def _stream(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, got: list[tuple[float, int]]) -> int:
    """Stream SGLang's native ``/generate``, appending (arrival time, tokens generated so far) per
    chunk (``meta_info.completion_tokens``: a count, where a random model's text may be empty); its
    prompt tokens."""
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    prompt_tokens = 0
    async with s.post(f"{url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            assert "error" not in doc, doc
            meta = doc["meta_info"]
            got.append((time.monotonic(), meta["completion_tokens"]))
            prompt_tokens = meta["prompt_tokens"]
    return prompt_tokens


async def _tokens_while_a_long_prompt_prefills(url: str, decoders: int) -> tuple[int, list[int]]:
    """``decoders`` requests decoding, then a long prompt: its prompt tokens, and how many tokens each
    decoding request generated between the long prompt's send and its first token."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        got: list[list[tuple[float, int]]] = [[] for _ in range(decoders)]
        tasks = [asyncio.create_task(_stream(s, url, f"question {i} " * 8, 3_000, got[i])) for i in range(decoders)]
        try:
            deadline = time.monotonic() + 60
            while min((g[-1][1] if g else 0) for g in got) < 5:
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), "the decoders did not start"
                await asyncio.sleep(0.005)
            long: list[tuple[float, int]] = []
            t0 = time.monotonic()
            prompt_tokens = await _stream(s, url, f"probe {decoders}: {LONG_WORDS}", 1, long)
            assert all(not t.done() for t in tasks), "a decoder finished before the long prompt's first token"
            first = long[0][0]

            def upto(g: list[tuple[float, int]], t: float) -> int:
                return max((n for at, n in g if at <= t), default=0)

            return prompt_tokens, [upto(g, first) - upto(g, t0) for g in got]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# tokens a decoding request may get at the window's edges: the steps between the long prompt's send
# and the start of its prefill (its tokenization; longer on a loaded machine), and the step its first
# token rides with. Seen here: 1-2.
EDGE = 8


def _check(name: str, prompt_tokens: int, alone: list[int], pair: list[int]) -> None:
    chunks = math.ceil(prompt_tokens / CHUNK_TOKENS)
    assert chunks >= 4, (name, prompt_tokens)
    steps = INTERVAL * (chunks - 1)
    # one request decoding (under the interval's minimum): nothing between the chunks
    assert alone[0] <= EDGE < steps, (name, alone, chunks)
    # two decoding: INTERVAL rounds after every chunk but the last (one token each, no speculation)
    for n in pair:
        assert steps <= n <= steps + EDGE, (name, pair, chunks)


async def test_a_long_prefill_stalls_the_running_requests_unless_the_interval_lets_them_step(
    interval_server: RealServer,
) -> None:
    real: dict[str, Any] = {}
    for k in (1, 2):
        real[f"decoders={k}"] = await _tokens_while_a_long_prompt_prefills(interval_server.url, k)
    prof = emulator_config().profile.with_overrides(
        chunked_prefill_size=CHUNK_TOKENS, prefill_decode_interval=INTERVAL, prefill_decode_interval_min_bs=INTERVAL_MIN_BS,
    )  # fmt: skip
    emu: dict[str, Any] = {}
    async with running_emulators(1, config=emulator_config(profile=prof, time_scale=1.0)) as (rep,):
        for k in (1, 2):
            emu[f"decoders={k}"] = await _tokens_while_a_long_prompt_prefills(rep.url, k)
    print(json.dumps({"real": real, "emulator": emu}))
    for name, got in (("real", real), ("emulator", emu)):
        (p1, alone), (p2, pair) = got["decoders=1"], got["decoders=2"]
        assert p1 == p2
        _check(name, p1, alone, pair)

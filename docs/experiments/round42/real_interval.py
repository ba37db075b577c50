"""Round 42: does a real SGLang stall its running requests while it prefills a long prompt, and does
--prefill-decode-interval N let them step between the chunks (timemodel Rule 1)? Two CPU servers
(docs/REAL_SGLANG.md), chunked prefill of CHUNK tokens, one with the interval; on each: one request
decoding, then a long prompt. Prints, per server, the tokens the decoding request got while the long
prompt was prefilled, its longest gap between tokens, and the long prompt's time to first token.
    PYTHONPATH=. python docs/experiments/round42/real_interval.py [N] [CHUNK]
"""
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtests.procs import free_port
from loadtests.real_sglang import start_real_server, stop_real_server, wait_healthy

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
CHUNK = int(sys.argv[2]) if len(sys.argv) > 2 else 512
WORDS = 2500


async def stream(c: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, times: list[float]) -> None:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if '"error"' in line:
                raise RuntimeError(line[:300])
            if line.startswith("data: {"):
                times.append(time.monotonic())


async def probe(url: str) -> dict:
    async with httpx.AsyncClient(timeout=300) as c:
        dec: list[float] = []
        a = asyncio.create_task(stream(c, url, "hello " * 20, 3000, dec))
        while len(dec) < 20:
            await asyncio.sleep(0.01)
        long: list[float] = []
        t0 = time.monotonic()
        await stream(c, url, " ".join(f"w{i}" for i in range(WORDS)), 1, long)
        ft = long[0]
        inside = [t for t in dec if t0 <= t <= ft]
        gaps = [b - a_ for a_, b in zip([t0, *inside], [*inside, ft])]
        a.cancel()
        return {"tokens_during_prefill": len(inside), "longest_gap_s": round(max(gaps), 3),
                "ttft_long_s": round(ft - t0, 3), "decode_gap_before_s": round((dec[19] - dec[9]) / 10, 4)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        servers = {n: start_real_server(free_port(), i % 2, log_dir=Path(tmp), max_total_tokens=20_000,
                                        context_length=16_384,
                                        sets=[f"chunked-prefill-size={CHUNK}", f"prefill-decode-interval={n}"])
                   for i, n in enumerate((0, N))}
        try:
            wait_healthy(list(servers.values()), timeout_s=300)
            for n, s in servers.items():
                print(json.dumps({"interval": n, "chunk": CHUNK, **asyncio.run(probe(s.url))}), flush=True)
        finally:
            for s in servers.values():
                stop_real_server(s)


main()

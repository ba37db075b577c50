"""Rule 8 through the live gateway: a session's warm turn that would wait behind a long prefill at
home goes to another replica with a host tier, for that request only; its ledger empties after.

Two emulated replicas (``small-test``: 8k tokens of HBM, a 16k host tier), slowed so that a 6k-token
cold prefill lasts ~3 s. The session sends a long request of its own (another conversation: it
goes home, and is its home's prefill queue), and while that prefills, its main conversation's next
turn.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from replica.emulator.profiles import get_profile
from replica.emulator.runner import Running, start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from tests.router.conftest import wait_for

TIME_SCALE = 25.0  # wall seconds per modelled second: the 6k-token prefill takes ~3 s
SID = "spill-1"


@pytest.fixture
async def emulators() -> AsyncIterator[Any]:
    started: list[Running] = []

    async def make(n: int, **profile: Any) -> list[Running]:
        config = EmulatorConfig(profile=get_profile("small-test").with_overrides(**profile), time_scale=TIME_SCALE)
        reps = await start_emulators(n, config=config, first_index=len(started))
        started.extend(reps)
        return reps

    yield make
    await stop_emulators(started)


def _body(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "emulated/small-test", "messages": messages, "max_tokens": 2}).encode()


async def _post(s: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> tuple[str, str]:
    headers = {"Content-Type": "application/json", "Modal-Session-Id": SID}
    async with s.post(url + "/v1/chat/completions", data=_body(messages), headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["X-Kvroute-Replica"], r.headers["X-Kvroute-Reason"]


@pytest.mark.parametrize(
    ("host_tokens", "factor", "reason"),
    [(16_384, 2.0, "queue_spill"), (0, 2.0, "affinity"), (16_384, 0.0, "affinity")],
    ids=["host-tier", "no-host-tier", "rule-off"],
)
async def test_a_warm_turn_behind_a_long_prefill_leaves_home_for_that_request_only(
    emulators: Any, gateway_factory: Any, host_tokens: int, factor: float, reason: str
) -> None:
    reps = await emulators(2, host_capacity_tokens=host_tokens)
    gw = await gateway_factory([r.url for r in reps], policy_params={"queue_spill_factor": factor})
    rt = gw.runtime
    # both replicas ACTIVE and scraped (the host tier's room is the engines' own report)
    await wait_for(lambda: _scraped(rt), 10.0)
    turn1 = [{"role": "user", "content": "Fix the failing test in parser.py. " * 20}]  # ~180 tokens
    async with aiohttp.ClientSession() as s:
        home, why = await _post(s, gw.url, turn1)
        assert why == "placed_new"
        # a long request of the same session (a sub-agent reading a big file): it goes home and is
        # that replica's prefill queue for ~3 s
        long_prompt = [{"role": "user", "content": "Summarise this module.\n" + "def f(x): return x\n" * 1_300}]
        long_req = asyncio.create_task(_post(s, gw.url, long_prompt))
        await wait_for(lambda: len(rt.prefill) == 1, 5.0)
        assert dict(rt.prefill.ahead()).get(home, 0) > 5_000
        turn2 = [*turn1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Now run it."}]
        where, why = await _post(s, gw.url, turn2)
        assert (await long_req)[0] == home
    assert why == reason
    assert (where != home) == (reason == "queue_spill")
    snap = await rt.store.snapshot(SID)
    assert snap.session is not None and snap.session.home == home  # not rebound
    assert len(rt.prefill) == 0 and rt.prefill.ahead() == {}  # nothing left ahead of anyone


async def _scraped(rt: Any) -> bool:
    snap = await rt.store.snapshot(None)
    return len(snap.replicas) == 2 and all(
        r.status.value == "active" and r.engine.updated_at > 0 for r in snap.replicas
    )

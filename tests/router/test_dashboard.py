"""The dashboard in a real headless Chromium (the distribution's package, driven by Playwright).

It renders, shows the replicas and the numbers ``/admin/stats`` reports, and updates when the fleet
changes. A screenshot is saved to ``test-output/dashboard.png``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.clock import VirtualClock
from router.gateway.admin import AdminSettings, PolicyHolder
from router.model import (
    BindSession,
    EngineLoad,
    Reason,
    ReplicaSpec,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
)
from router.observability.surface import make_operator_surface
from router.policy.params import PolicyParams
from router.store.memory import MemoryStore
from tests.ci import missing

CHROMIUM = os.environ.get("KVROUTE_CHROMIUM", "/usr/bin/chromium")
TOKEN = "dash-token"
OUT = Path(__file__).resolve().parents[2] / "test-output"

pytestmark = pytest.mark.slow


def _need_browser() -> None:
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        missing(f"chromium not found at {CHROMIUM} (apt-get install -y chromium)")


async def _server() -> tuple[TestServer, MemoryStore, Any]:
    clock = VirtualClock(1000.0)
    store = MemoryStore(clock)
    for i in range(4):
        store.core.upsert_replica(
            ReplicaSpec(id=f"127.0.0.1:{41001 + i}", url=f"http://127.0.0.1:{41001 + i}"),
            ReplicaStatus.ACTIVE,
        )
    store.core.report_engine_load(
        "127.0.0.1:41001", EngineLoad(running=3, queued=2, kv_util=0.42, cache_hit_rate=0.97)
    )
    for n, rid in enumerate(["127.0.0.1:41001", "127.0.0.1:41001", "127.0.0.1:41002"]):
        store.core.acquire(
            RouteDecision(rid, Reason.PLACED_NEW, (BindSession(f"s{n}", rid, None, Reason.PLACED_NEW),)),
            RouteRequest(session_key=f"s{n}"),
        )
    surface = make_operator_surface(
        store=store,
        clock=clock,
        holder=PolicyHolder("kv_aware", PolicyParams()),
        admin=AdminSettings(token=TOKEN),
        sample_interval_s=0.1,
    )
    surface.stats.record_decision(clock.now(), "placed_new")
    surface.stats.record_decision(clock.now(), "affinity")
    surface.stats.record_finished(clock.now(), status="200", prompt_tokens=1000, cached_tokens=800)
    surface.stats.record_break(clock.now(), "evicted", "127.0.0.1:41002")
    for found in (True, True, False):
        surface.stats.record_residency_outcome(clock.now(), "events", found)
    app = web.Application()
    surface.setup(app)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return server, store, surface


async def _cells(page: Any, rid: str) -> dict[str, str]:
    row = page.locator(f'tr[data-replica="{rid}"]')
    out: dict[str, str] = {}
    for td in await row.locator("td").all():
        out[await td.get_attribute("data-field") or ""] = (await td.text_content()) or ""
    return out


async def test_dashboard_renders_stats_and_updates() -> None:
    _need_browser()
    from playwright.async_api import async_playwright

    server, store, surface = await _server()
    base = str(server.make_url("")).rstrip("/")
    OUT.mkdir(exist_ok=True)

    async def traffic() -> None:
        # virtual time moves and responses with varying cache hits arrive, so the series has a shape
        clock = surface.clock
        for i in range(10_000):
            await asyncio.sleep(0.05)
            clock.advance(1.0)
            surface.stats.record_finished(
                clock.now(), status="200", prompt_tokens=1000, cached_tokens=600 + (i * 37) % 400
            )

    feeder: asyncio.Task[None] | None = None
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM,
                args=[
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ],
            )
            try:
                page = await browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                # the token is exchanged for an HttpOnly cookie, then the page polls /admin/stats
                await page.goto(f"{base}/admin/ui?token={TOKEN}&interval=300")
                assert page.url.endswith("/admin/ui?interval=300")
                await page.wait_for_function("Number(document.body.dataset.polls || 0) >= 1", timeout=15_000)

                async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                    stats = await (await http.get(f"{base}/admin/stats")).json()
                # every replica /admin/stats reports is a row with the same numbers
                for rep in stats["replicas"]:
                    cells = await _cells(page, rep["id"])
                    assert cells["id"] == rep["id"]
                    assert cells["status"] == rep["status"]
                    assert cells["in_flight"] == str(rep["in_flight"])
                    assert cells["sessions_active"] == str(rep["sessions_active"])
                    assert cells["running"] == str(rep["running"]) and cells["queued"] == str(rep["queued"])
                    assert cells["affinity_breaks"] == str(rep["affinity_breaks"])
                    assert cells["residency_source"] == rep["residency_source"]
                first = await _cells(page, "127.0.0.1:41001")
                assert (
                    first["in_flight"] == "2"
                    and first["kv_util"] == "42.0%"
                    and first["engine_cache_hit_rate"] == "97.0%"
                )
                fleet = stats["fleet"]
                assert await page.text_content("#kpi-in-flight") == str(fleet["in_flight"]) == "3"
                assert await page.text_content("#kpi-replicas") == "4 / 4"
                assert await page.text_content("#kpi-dispersion-now") == f"{fleet['dispersion_now']:.3f}"
                assert await page.text_content("#kpi-chr-total") == "80.0%"
                assert await page.text_content("#policy") == "kv_aware"
                # histogram bars: loads {0: 2, 1: 1, 2: 1}
                bars = {
                    await b.get_attribute("data-load"): await b.get_attribute("data-count")
                    for b in await page.locator("#hist rect").all()
                }
                assert (
                    bars
                    == {"0": "2", "1": "1", "2": "1"}
                    == {k: str(v) for k, v in fleet["load_histogram"].items()}
                )
                assert await page.locator('#decisions [data-key="placed_new"] .num').text_content() == "1"
                assert await page.locator('#breaks [data-key="evicted"] .num').text_content() == "1"
                outcomes = page.locator("#residency-outcomes .num")
                assert await page.locator('#residency-outcomes [data-key="events_found"] .num').text_content() == "2"
                assert await page.locator('#residency-outcomes [data-key="events_missed"] .num').text_content() == "1"
                assert await outcomes.count() == 2

                # the fleet changes: a new in-flight request on replica 3 and a drained replica 4,
                # virtual time moves on and more responses arrive
                feeder = asyncio.create_task(traffic())
                store.core.acquire(
                    RouteDecision("127.0.0.1:41003", Reason.PLACED_NEW), RouteRequest(session_key=None)
                )
                store.core.set_status("127.0.0.1:41004", ReplicaStatus.DRAINING)
                await page.wait_for_function(
                    """() => { const td = document.querySelector('tr[data-replica="127.0.0.1:41003"] td[data-field="in_flight"]');
                               return td && td.textContent === "1"; }""",
                    timeout=15_000,
                )
                assert (await _cells(page, "127.0.0.1:41004"))["status"] == "draining"
                assert await page.text_content("#kpi-in-flight") == "4"
                assert await page.text_content("#kpi-replicas") == "3 / 4"
                await page.wait_for_function(
                    "document.querySelectorAll('#series-dispersion').length === 1", timeout=15_000
                )
                assert await page.text_content("#error") == ""
                assert errors == []
                await page.wait_for_function(
                    "document.querySelectorAll('#series-chr').length === 1", timeout=15_000
                )
                await page.screenshot(path=str(OUT / "dashboard.png"), full_page=True)
            finally:
                await browser.close()
    finally:
        if feeder is not None:
            feeder.cancel()
        await server.close()
    assert (OUT / "dashboard.png").stat().st_size > 10_000


async def test_dashboard_without_auth_shows_nothing() -> None:
    _need_browser()
    from playwright.async_api import async_playwright

    server, _, _ = await _server()
    base = str(server.make_url("")).rstrip("/")
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
            )
            try:
                page = await browser.new_page()
                resp = await page.goto(f"{base}/admin/ui")
                assert resp is not None and resp.status == 401
                assert "unauthorized" in (await page.content())
            finally:
                await browser.close()
    finally:
        await server.close()

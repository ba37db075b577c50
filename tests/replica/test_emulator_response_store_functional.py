"""The emulator's Responses API with its response store on (``enable_response_store``, SGLang's
``--enable-response-store``) over real sockets: stored responses (unstreamed, streamed, background),
``previous_response_id`` continuations and their cached prefix, GET and cancel, the errors (shapes
checked against real SGLang in tests/real_sglang/test_responses_fidelity.py). Without the option the
store is refused as SGLang refuses it (test_emulator_responses_functional.py::test_errors)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from replica.emulator.runner import Running
from tests.replica.conftest import EmuFactory
from tests.replica.test_emulator_responses_functional import (
    KEYS,
    Q,
    _err,
    chat_usage,
    events,
    post,
    prompt_tokens,
)
from tests.router.conftest import wait_for


async def get(http: aiohttp.ClientSession, emu: Running, response_id: str, suffix: str = "") -> tuple[int, bytes]:
    method = "POST" if suffix else "GET"
    async with http.request(method, f"{emu.url}/v1/responses/{response_id}{suffix}") as r:
        assert r.headers["Content-Type"] == "application/json"
        return r.status, await r.read()


async def statuses_until_done(http: aiohttp.ClientSession, emu: Running, response_id: str,
                              timeout_s: float = 10.0) -> tuple[list[str], dict[str, Any]]:
    """The distinct statuses GET shows, polled until the response leaves queued/in_progress, and the
    final response."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, raw = await get(http, emu, response_id)
        assert status == 200, raw
        doc = json.loads(raw)
        if not seen or seen[-1] != doc["status"]:
            seen.append(doc["status"])
        if doc["status"] not in ("queued", "in_progress"):
            return seen, doc
        assert (doc["output"], doc["usage"]) == ([], None), doc  # nothing of the answer until it ends
        await asyncio.sleep(0.01)
    raise AssertionError(f"{response_id} still {seen} after {timeout_s} s")


async def state(http: aiohttp.ClientSession, emu: Running) -> dict[str, Any]:
    async with http.get(f"{emu.url}/_emulator/state") as r:
        return dict(await r.json())


async def _in_flight_is_zero(http: aiohttp.ClientSession, emu: Running) -> bool:
    return bool((await state(http, emu))["in_flight"] == 0)


async def test_previous_response_id_continues_the_conversation(
    emulators: EmuFactory, http: aiohttp.ClientSession
) -> None:
    """Each turn's prompt is the stored conversation (earlier inputs and outputs) + its own input,
    after its own instructions, exactly the chat conversation SGLang builds: the same prompt tokens
    as that conversation on the chat route, and the previous turn is a cache hit."""
    async with emulators(1, enable_response_store=True) as (emu,):
        page = emu.replica.config.page_size
        url = f"{emu.url}/v1/responses"
        base = {"model": emu.replica.config.model_name, "instructions": "Be terse.", "temperature": 0}
        status, _, raw = await post(http, url, {**base, "input": Q, "max_output_tokens": 10})
        first = json.loads(raw)
        assert status == 200 and first["store"] is True and first["previous_response_id"] is None
        status, got = await get(http, emu, first["id"])
        assert (status, got) == (200, raw)  # the very bytes the POST answered

        _, _, raw = await post(http, url, {**base, "input": "Add type hints.", "max_output_tokens": 6,
                                           "previous_response_id": first["id"]})
        second = json.loads(raw)
        assert second["previous_response_id"] == first["id"] and second["instructions"] == "Be terse."
        chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": Q},
                {"role": "assistant", "content": [{"type": "text", "text": first["output"][0]["content"][0]["text"]}],
                 "phase": "final_answer"},
                {"role": "user", "content": "Add type hints."}]
        p1, p2 = first["usage"]["input_tokens"], prompt_tokens(chat)
        assert second["usage"]["input_tokens"] == p2 and second["usage"]["total_tokens"] == p2 + 4
        # turn 1's prompt and answer, in whole pages (its answer's last token was never computed)
        assert second["usage"]["input_tokens_details"]["cached_tokens"] == (p1 + 8 - 1) // page * page > 0

        # turn 3, streamed, items as input, other instructions (earlier ones are not kept)
        body = {**base, "instructions": "Be kind.", "input": [{"role": "user", "content": "And a docstring."}],
                "max_output_tokens": 5, "stream": True, "previous_response_id": second["id"]}
        _, _, raw = await post(http, url, body)
        third = events(raw)[-1]["response"]
        chat3 = [{"role": "system", "content": "Be kind."}, *chat[1:],
                 {"role": "assistant", "content": [{"type": "text",
                                                    "text": second["output"][0]["content"][0]["text"]}],
                  "phase": "final_answer"},
                 {"role": "user", "content": "And a docstring."}]
        assert third["usage"]["input_tokens"] == prompt_tokens(chat3) and third["usage"]["output_tokens"] == 3
        assert third["previous_response_id"] == second["id"]
        # the same conversation on the chat route: the same prompt, cached up to turn 3's answer
        cu = await chat_usage(http, emu, chat3)
        assert cu["prompt_tokens"] == prompt_tokens(chat3)
        assert cu["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens(chat3) + 3 - 1) // page * page


async def test_streamed_and_incomplete_responses_are_stored(
    emulators: EmuFactory, http: aiohttp.ClientSession
) -> None:
    async with emulators(1, enable_response_store=True) as (emu,):
        body = {"model": emu.replica.config.model_name, "input": Q, "max_output_tokens": 6, "stream": True}
        _, _, raw = await post(http, f"{emu.url}/v1/responses", body)
        final = events(raw)[-1]["response"]
        assert final["status"] == "incomplete" and final["store"] is True
        status, got = await get(http, emu, final["id"])
        assert status == 200 and got == json.dumps(final, separators=(",", ":"), ensure_ascii=False).encode()
        # an empty answer is kept too, and a continuation of it adds no item
        _, _, raw = await post(http, f"{emu.url}/v1/responses", {**body, "max_output_tokens": 2, "stream": False})
        empty = json.loads(raw)
        status, got = await get(http, emu, empty["id"])
        assert status == 200 and json.loads(got)["output"] == [] and json.loads(got)["status"] == "incomplete"
        _, _, raw = await post(http, f"{emu.url}/v1/responses", {**body, "input": "more", "stream": False,
                                                                  "previous_response_id": empty["id"]})
        chat = [{"role": "user", "content": Q}, {"role": "user", "content": "more"}]
        assert json.loads(raw)["usage"]["input_tokens"] == prompt_tokens(chat)


async def test_errors_with_the_store(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, enable_response_store=True) as (emu,):
        model = emu.replica.config.model_name
        url = f"{emu.url}/v1/responses"
        async with http.get(f"{emu.url}/server_info") as r:
            assert (await r.json())["enable_response_store"] is True  # as SGLang reports its flag
        not_found = _err("Response with id 'resp_nope' not found.", 404, param="response_id")
        invalid = _err("Invalid 'response_id': 'nope'. Expected an ID that begins with 'resp'.", param="response_id")
        for response_id, want in (("resp_nope", not_found), ("nope", invalid)):
            for suffix in ("", "/cancel"):
                status, raw = await get(http, emu, response_id, suffix)
                assert (status, json.loads(raw)) == want, (response_id, suffix)
            for stream in (False, True):
                async with http.post(url, json={"model": model, "input": "hi", "stream": stream,
                                                "previous_response_id": response_id}) as r:
                    assert (r.status, await r.json()) == want, (response_id, stream)
        async with http.post(url, json={"model": "gpt-5", "input": "hi", "background": True, "store": False}) as r:
            assert (r.status, await r.json()) == _err("background=true requires store=true.", param="store")
        # not kept: store false, a request the engine refused (unstreamed or streamed), one's own id
        # without the resp_ prefix (kept, but no lookup accepts it)
        _, _, raw = await post(http, url, {"model": model, "input": "hi", "max_output_tokens": 4, "store": False})
        unstored = json.loads(raw)["id"]
        status, raw = await get(http, emu, unstored)
        assert (status, json.loads(raw)) == _err(f"Response with id '{unstored}' not found.", 404, param="response_id")
        for stream in (False, True):
            rid = f"resp_refused{int(stream)}"
            await post(http, url, {"model": model, "input": "hi", "max_output_tokens": 1, "stream": stream,
                                   "request_id": rid})
            assert (await get(http, emu, rid))[0] == 404
        status, _, raw = await post(http, url, {"model": model, "input": "hi", "max_output_tokens": 4,
                                                "request_id": "mine"})
        assert status == 200 and json.loads(raw)["id"] == "mine" and (await get(http, emu, "mine"))[0] == 400
        # no other methods or sub-resources, as FastAPI answers them
        async with http.delete(f"{url}/resp_nope") as r:
            assert (r.status, await r.json()) == (405, {"detail": "Method Not Allowed"})
        async with http.get(f"{url}/resp_nope/input_items") as r:
            assert (r.status, await r.json()) == (404, {"detail": "Not Found"})


async def test_background_request_runs_after_the_answer(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    """``background``: answered at once ``queued`` (no output, no usage), then ``in_progress`` while
    it runs, then its final response, which GET shows; what it stored continues as any response.
    (time_scale 1: 200 tokens decode in ~0.9 s wall.)"""
    async with emulators(1, enable_response_store=True, time_scale=1.0) as (emu,):
        body = {"model": emu.replica.config.model_name, "instructions": "Be terse.", "input": Q,
                "max_output_tokens": 202, "background": True, "temperature": 0}
        status, ctype, raw = await post(http, f"{emu.url}/v1/responses", body)
        assert (status, ctype) == (200, "application/json")
        queued = json.loads(raw)  # answered before the run: "queued" (a wall-clock bound would be flaky)
        assert list(queued) == KEYS and queued["id"].startswith("resp_")
        assert (queued["status"], queued["output"], queued["usage"], queued["text"]) == ("queued", [], None, None)
        assert queued["incomplete_details"] is None and queued["max_output_tokens"] == 202
        seen, final = await statuses_until_done(http, emu, queued["id"])
        assert seen == ["in_progress", "incomplete"], seen
        assert final["created_at"] == queued["created_at"] and final["text"] == {"format": {"type": "text"}}
        p = prompt_tokens([{"role": "system", "content": "Be terse."}, {"role": "user", "content": Q}])
        assert final["usage"]["input_tokens"] == p and final["usage"]["output_tokens"] == 200
        assert len(final["output"][0]["content"][0]["text"]) == 200 * 4
        assert {k: v for k, v in final.items() if k not in ("output", "status", "usage", "incomplete_details", "text")} \
            == {k: v for k, v in queued.items() if k not in ("output", "status", "usage", "incomplete_details", "text")}
        assert (await state(http, emu))["requests_served"] == 1
        # cancelling a finished response changes nothing
        status, raw = await get(http, emu, queued["id"], "/cancel")
        assert status == 200 and json.loads(raw) == final
        _, _, raw = await post(http, f"{emu.url}/v1/responses", {**body, "background": False, "input": "more",
                                                                  "max_output_tokens": 4,
                                                                  "previous_response_id": queued["id"]})
        assert json.loads(raw)["usage"]["input_tokens_details"]["cached_tokens"] >= p


async def test_cancel_aborts_a_background_run(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, enable_response_store=True, time_scale=1.0) as (emu,):
        body = {"model": emu.replica.config.model_name, "input": Q, "max_output_tokens": 2002, "background": True}
        _, _, raw = await post(http, f"{emu.url}/v1/responses", body)
        rid = json.loads(raw)["id"]
        status, raw = await get(http, emu, rid)
        assert json.loads(raw)["status"] == "in_progress" and (await state(http, emu))["running"] == 1
        status, raw = await get(http, emu, rid, "/cancel")
        doc = json.loads(raw)
        assert status == 200 and (doc["status"], doc["output"], doc["usage"]) == ("cancelled", [], None)
        st = await state(http, emu)
        assert (st["requests_aborted"], st["requests_served"]) == (1, 0)
        assert not emu.replica.background  # the run is over
        # a decoding request leaves the batch at the next step boundary, as SGLang's abort does
        await wait_for(lambda: _in_flight_is_zero(http, emu), timeout_s=5.0)
        st = await state(http, emu)
        assert (st["in_flight"], st["requests_aborted"], st["requests_served"]) == (0, 1, 0)
        assert (await get(http, emu, rid)) == (200, raw) and (await get(http, emu, rid, "/cancel")) == (200, raw)
        # its conversation is its input alone
        _, _, raw = await post(http, f"{emu.url}/v1/responses", {**body, "background": False, "input": "more",
                                                                  "max_output_tokens": 4, "previous_response_id": rid})
        chat = [{"role": "user", "content": Q}, {"role": "user", "content": "more"}]
        assert json.loads(raw)["usage"]["input_tokens"] == prompt_tokens(chat)


async def test_background_request_the_engine_refuses_fails(
    emulators: EmuFactory, http: aiohttp.ClientSession
) -> None:
    """The engine's refusals come from the run, after ``queued``: the response is ``failed``, with
    neither output nor error, as SGLang leaves it; the serving layer's are the usual 400s."""
    async with emulators(1, enable_response_store=True) as (emu,):
        base = {"model": emu.replica.config.model_name, "input": Q, "background": True}
        for extra in ({"max_output_tokens": 1}, {"temperature": -1}, {"input": "abcd" * 20_000}):
            _, _, raw = await post(http, f"{emu.url}/v1/responses", {**base, **extra})
            queued = json.loads(raw)
            assert queued["status"] == "queued", extra
            seen, final = await statuses_until_done(http, emu, queued["id"])
            assert seen[-1] == "failed" and final == {**queued, "status": "failed"}, (extra, seen)
        async with http.post(f"{emu.url}/v1/responses", json={**base, "input": []}) as r:
            assert (r.status, await r.json()) == _err(
                "Cannot apply chat template to an empty conversation. Provide at least one message. None")


async def test_background_stream_is_an_ordinary_stream(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, enable_response_store=True) as (emu,):
        body = {"model": emu.replica.config.model_name, "input": Q, "max_output_tokens": 6, "background": True,
                "stream": True}
        status, ctype, raw = await post(http, f"{emu.url}/v1/responses", body)
        evs = events(raw)
        assert (status, ctype) == (200, "text/event-stream; charset=utf-8") and evs[0]["type"] == "response.created"
        final = evs[-1]["response"]
        assert final["status"] == "incomplete" and json.loads((await get(http, emu, final["id"]))[1]) == final


async def test_stopping_cancels_background_runs(emulators: EmuFactory, http: aiohttp.ClientSession) -> None:
    async with emulators(1, enable_response_store=True, time_scale=1.0) as (emu,):
        body = {"model": emu.replica.config.model_name, "input": Q, "max_output_tokens": 2002, "background": True}
        await post(http, f"{emu.url}/v1/responses", body)
        [task] = emu.replica.background.values()
        assert not task.done()
    assert task.done() and not emu.replica.flights and emu.replica.metrics.aborted == 1

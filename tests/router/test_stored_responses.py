"""The pure parts of ``router/gateway/stored_responses.py``: which Responses requests keep their
answer, where an answer names its id, and what a request continues. The gateway's behaviour over
sockets is in ``test_gateway_emulator.py`` (emulated engines with the store) and
``tests/real_sglang/test_conformance.py`` (real SGLang with ``--enable-response-store``)."""

from __future__ import annotations

import json

import pytest

from router.config import GatewayConfig
from router.errors import BadRequestError
from router.gateway.background import running_response
from router.gateway.stored_responses import keeps_response, previous_response_id, response_id_in

RID = "resp_" + "ab12" * 8


@pytest.mark.parametrize(
    ("body", "kept"),
    [
        (b'{"input":"hi"}', True),  # store defaults to true (OpenAI's and SGLang's default)
        (b'{"input":"hi","store":true}', True),
        (b'{"input":"hi","store":false}', False),
        (b'{"input":"hi", "store" :  false }', False),  # any JSON spacing
        (json.dumps({"input": "x" * 500_000, "store": False}).encode(), False),  # a Codex-sized body
        (b'{"input":"the word \\"store\\" is in the text","store":true}', True),
        (b'{"metadata":{"store":"false"}}', True),  # a string, not false
    ],
)
def test_keeps_response(body: bytes, kept: bool) -> None:
    assert keeps_response(body) is kept


def test_response_id_in_the_first_bytes() -> None:
    unstreamed = json.dumps({"id": RID, "object": "response", "output": [{"id": "msg_1"}]}).encode()
    assert response_id_in(unstreamed) == RID
    created = (
        b"event: response.created\ndata: "
        + json.dumps({"type": "response.created", "response": {"id": RID, "status": "in_progress"}}).encode()
        + b"\n\n"
    )
    assert response_id_in(created) == RID
    # a message item's id, an error body, a cut-off id: nothing to pin
    assert response_id_in(b'{"item":{"id":"msg_1"}}') is None
    assert response_id_in(b'{"error":{"message":"bad","code":400}}') is None
    assert response_id_in(b'{"id":"resp_ab') is None
    # never an id the gateway could not put back in a URL path verbatim
    assert response_id_in(b'{"id":"resp_../../flush_cache"}') is None
    assert response_id_in(b'{"id":"resp_' + b"a" * 201 + b'"}') is None


def test_previous_response_id() -> None:
    cfg = GatewayConfig()
    assert previous_response_id(b'{"input":"hi"}', cfg) is None
    assert previous_response_id(json.dumps({"previous_response_id": RID}).encode(), cfg) == RID
    # absent, null, not a string, a body that does not parse: the engine's to judge
    assert previous_response_id(b'{"previous_response_id":null}', cfg) is None
    assert previous_response_id(b'{"previous_response_id":7}', cfg) is None
    assert previous_response_id(b'{"previous_response_id":', cfg) is None
    with pytest.raises(BadRequestError, match="previous_response_id"):  # past the id limits: refused here
        previous_response_id(json.dumps({"previous_response_id": "resp_" + "a" * 5000}).encode(), cfg)


@pytest.mark.parametrize(
    ("doc", "running"),
    [
        ({"id": RID, "object": "response", "status": "queued"}, RID),  # SGLang's answer to background
        ({"id": RID, "object": "response", "status": "in_progress"}, RID),
        ({"id": RID, "object": "response", "status": "completed"}, None),  # an ordinary answer
        ({"id": RID, "object": "response", "status": "incomplete"}, None),
        ({"id": RID, "object": "chat.completion", "status": "queued"}, None),
        ({"id": 7, "object": "response", "status": "queued"}, None),  # hostile: not an id
        ({"id": "resp_1/../../admin?x=\r\n", "object": "response", "status": "queued"}, None),  # not SGLang's shape
        ({"object": "response", "status": "queued"}, None),
        ([{"id": RID, "object": "response", "status": "queued"}], None),
        (None, None),  # the body did not parse
    ],
)
def test_running_response(doc: object, running: str | None) -> None:
    """Which answers leave a run going on the engine (router/gateway/background.py rule 1)."""
    assert running_response(doc) == running

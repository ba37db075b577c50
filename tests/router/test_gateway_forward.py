"""Pure parts of the forwarder: hop-by-hop header hygiene, usage extraction, the SSE sniffer."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.errors import UpstreamConnectError
from router.gateway.forward import (
    ConnectFailure,
    Usage,
    UsageSniffer,
    filter_request_headers,
    filter_response_headers,
    is_connect_failure,
    usage_from_json,
)
from router.gateway.handlers import sse_error_event


def test_request_headers_drop_hop_by_hop_and_connection_named() -> None:
    given = [
        ("Host", "evil.example"),
        ("Connection", "keep-alive, X-Secret-Hop"),
        ("Keep-Alive", "timeout=5"),
        ("Proxy-Authorization", "Basic x"),
        ("TE", "trailers"),
        ("Trailer", "X"),
        ("Transfer-Encoding", "chunked"),
        ("Upgrade", "h2c"),
        ("X-Secret-Hop", "1"),
        ("Content-Length", "12"),
        ("Expect", "100-continue"),
        ("Authorization", "Bearer k"),
        ("Content-Type", "application/json"),
        ("Modal-Session-Id", "s"),
        ("Accept", "text/event-stream"),
        ("x-custom", "a"),
        ("x-custom", "b"),
    ]
    assert filter_request_headers(given) == [
        ("Authorization", "Bearer k"),
        ("Content-Type", "application/json"),
        ("Modal-Session-Id", "s"),
        ("Accept", "text/event-stream"),
        ("x-custom", "a"),
        ("x-custom", "b"),
    ]


def test_response_headers() -> None:
    given = [
        ("Content-Type", "text/event-stream"),
        ("content-length", "10"),
        ("transfer-encoding", "chunked"),
        ("connection", "close"),
        ("Server", "uvicorn"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("Content-Encoding", "gzip"),
    ]
    assert filter_response_headers(given) == [
        ("Content-Type", "text/event-stream"),
        ("Server", "uvicorn"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("Content-Encoding", "gzip"),
    ]


@pytest.mark.parametrize(
    ("obj", "want"),
    [
        (
            {
                "usage": {
                    "prompt_tokens": 5210,
                    "completion_tokens": 311,
                    "prompt_tokens_details": {"cached_tokens": 4096},
                }
            },
            Usage(5210, 4096, 311),
        ),
        (
            {"usage": {"prompt_tokens": 12, "completion_tokens": 16, "prompt_tokens_details": None}},
            Usage(12, None, 16),
        ),
        ({"meta_info": {"prompt_tokens": 6, "cached_tokens": 0, "completion_tokens": 3}}, Usage(6, 0, 3)),
        (
            [
                {"meta_info": {"prompt_tokens": 6, "cached_tokens": 2, "completion_tokens": 3}},
                {"meta_info": {"prompt_tokens": 4, "cached_tokens": 1, "completion_tokens": 1}},
            ],
            Usage(10, 3, 4),
        ),
        ({"usage": None}, None),
        ({"choices": []}, None),
        ({"usage": {"prompt_tokens": "7"}}, None),
        ({"usage": {"prompt_tokens": True}}, None),
        ("text", None),
    ],
)
def test_usage_from_json(obj: object, want: Usage | None) -> None:
    assert usage_from_json(obj) == want


CHAT_STREAM = (
    b'data: {"id":"a","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    b'data: {"id":"a","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5210,"total_tokens":5521,'
    b'"completion_tokens":311,"prompt_tokens_details":{"cached_tokens":4096},"reasoning_tokens":120}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 3, 7, 64, 10_000])
def test_sse_sniffer_any_chunking(size: int) -> None:
    sn = UsageSniffer("text/event-stream; charset=utf-8")
    for i in range(0, len(CHAT_STREAM), size):
        sn.feed(CHAT_STREAM[i : i + size])
    assert sn.is_sse and sn.events == 3
    assert sn.result() == Usage(5210, 4096, 311)


def test_sse_sniffer_keeps_last_and_ignores_null_usage() -> None:
    completions = (
        b'data: {"choices":[{"text":" w"}],"usage":null}\r\n\r\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":12,"total_tokens":28,"completion_tokens":16,'
        b'"prompt_tokens_details":{"cached_tokens":0}}}\r\n\r\ndata: [DONE]\r\n\r\n'
    )
    sn = UsageSniffer("text/event-stream")
    sn.feed(completions)
    assert sn.result() == Usage(12, 0, 16)
    gen = b"".join(
        b'data: {"text":"x","meta_info":{"prompt_tokens":6,"completion_tokens":%d,"cached_tokens":2}}\n\n' % i
        for i in range(1, 4)
    )
    sn = UsageSniffer("text/event-stream")
    sn.feed(gen + b"data: [DONE]\n\n")
    assert sn.result() == Usage(6, 2, 3)


def test_sse_sniffer_without_usage_and_broken_json() -> None:
    sn = UsageSniffer("text/event-stream")
    sn.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n')
    assert sn.result() is None
    sn = UsageSniffer("text/event-stream")
    sn.feed(b'data: {"usage":{"prompt_tokens":1,\n\n')
    assert sn.result() is None


def test_sse_sniffer_overlong_line_is_skipped() -> None:
    sn = UsageSniffer("text/event-stream", max_line_bytes=100)
    sn.feed(b"data: " + b"x" * 500)
    sn.feed(b"y" * 500 + b"\n\n")
    sn.feed(b'data: {"meta_info":{"prompt_tokens":6,"cached_tokens":1,"completion_tokens":1}}\n\n')
    assert sn.result() == Usage(6, 1, 1)


def test_json_sniffer() -> None:
    body = json.dumps(
        {"usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}}
    ).encode()
    sn = UsageSniffer("application/json")
    for i in range(0, len(body), 5):
        sn.feed(body[i : i + 5])
    assert not sn.is_sse and sn.result() == Usage(9, 8, 2)
    big = UsageSniffer("application/json", max_json_bytes=10)
    big.feed(body)
    assert big.result() is None
    other = UsageSniffer("text/plain")
    other.feed(body)
    assert other.result() is None


def test_sse_error_event_is_parseable() -> None:
    raw = sse_error_event("replica died", 502)
    events = [e for e in raw.decode().split("\n\n") if e]
    error = {"type": "error", "error": {"message": "replica died", "type": "upstream_error", "code": 502}}
    assert json.loads(events[0].removeprefix("data: ")) == error
    assert events[1] == "data: [DONE]"
    # Anthropic's Messages API: an ``error`` event ends the stream, no [DONE]
    (event,) = [e for e in sse_error_event("replica died", 502, route="/v1/messages").decode().split("\n\n") if e]
    name, data = event.split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == error
    # OpenAI's Responses API: its own error event, numbered after the events relayed before it
    (event,) = [e for e in sse_error_event("replica died", route="/v1/responses", sequence=7).decode().split("\n\n") if e]
    name, data = event.split("\n")
    doc = {"type": "error", "code": "upstream_error", "message": "replica died", "param": None, "sequence_number": 7}
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == doc


def test_connect_failure_is_told_apart_by_its_cause() -> None:
    refused = UpstreamConnectError("r1: cannot connect")
    refused.__cause__ = ConnectFailure("refused")
    assert is_connect_failure(refused)
    dropped = UpstreamConnectError("r1: server disconnected")  # a reused keep-alive connection
    dropped.__cause__ = ConnectionResetError()
    assert not is_connect_failure(dropped)


@given(
    cuts=st.lists(st.integers(min_value=0, max_value=len(CHAT_STREAM)), max_size=30),
    crlf=st.booleans(),
)
def test_sse_sniffer_is_split_invariant(cuts: list[int], crlf: bool) -> None:
    raw = CHAT_STREAM.replace(b"\n", b"\r\n") if crlf else CHAT_STREAM
    bounds = sorted({0, len(raw), *(min(c, len(raw)) for c in cuts)})
    sn = UsageSniffer("text/event-stream")
    for a, b in itertools.pairwise(bounds):
        sn.feed(raw[a:b])
    assert sn.events == 3
    assert sn.result() == Usage(5210, 4096, 311)


def test_usage_of_a_batch_with_parallel_samples_counts_each_prompt_once() -> None:
    # SGLang's list for 2 prompts x n=2: a prompt's samples together, each with the prompt's counts
    def item(prompt: int, cached: int, out: int) -> dict[str, object]:
        return {"meta_info": {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": out}}

    docs = [item(100, 99, 5), item(100, 99, 7), item(40, 39, 3), item(40, 39, 4)]
    assert usage_from_json(docs, samples_per_prompt=2) == Usage(140, 138, 19)
    assert usage_from_json(docs) == Usage(280, 276, 19)  # a plain batch of four prompts

"""The SSE usage sniffer's whole-lines fast path (``forward.UsageSniffer.feed``) agrees with the
line-by-line path: events counted, the last usage candidate kept, nothing inside a JSON string
mistaken for a line start."""

from __future__ import annotations

from router.gateway.forward import Usage, UsageSniffer

_STREAM = [
    b'data: {"choices":[{"delta":{"content":"say \\"data: x\\"\\ndata: y"}}],"usage":null}\n\n',
    (
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":5}}}\n\n'
    ),
    b"data: [DONE]\n\n",
]


def test_whole_events_and_byte_by_byte_agree() -> None:
    whole = UsageSniffer("text/event-stream")
    for chunk in _STREAM:
        whole.feed(chunk)  # every chunk ends a line: the fast path
    bytewise = UsageSniffer("text/event-stream")
    for b in b"".join(_STREAM):
        bytewise.feed(bytes([b]))  # never a whole line: the line-by-line path
    assert whole.events == bytewise.events == 3
    assert whole.result() == bytewise.result() == Usage(7, 5, 2)


def test_crlf_and_comment_lines() -> None:
    sn = UsageSniffer("text/event-stream")
    sn.feed(b": keep-alive\r\n\r\ndata: {}\r\n\r\n")
    sn.feed(b'data: {"meta_info":{"prompt_tokens":3,"completion_tokens":1,"cached_tokens":0}}\r\n\r\n')
    assert sn.events == 2
    assert sn.result() == Usage(3, 0, 1)

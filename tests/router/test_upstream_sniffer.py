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


def test_an_error_event_in_a_200_stream_is_a_failure_with_nothing_to_learn() -> None:
    # SGLang 0.5.23, a streamed chat prompt its scheduler refuses: an error event (Python's spacing),
    # then a usage chunk that counts the one-token stand-in it ran
    refusal = [
        (
            b'data: {"error": {"object": "error", "message": "Input length (9000 tokens) exceeds", '
            b'"type": "BAD_REQUEST", "param": null, "code": 400}}\n\n'
        ),
        b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]
    for feed in ("whole", "bytewise"):
        sn = UsageSniffer("text/event-stream")
        for chunk in refusal:
            if feed == "whole":
                sn.feed(chunk)
            else:
                for b in chunk:
                    sn.feed(bytes([b]))
        assert sn.errored and sn.result() is None, feed
    compact = UsageSniffer("text/event-stream")  # /generate's tokenizer errors: compact JSON
    compact.feed(b'data: {"error":{"message":"max_new_tokens must be at least 0","code":400}}\n\ndata: [DONE]\n\n')
    assert compact.errored and compact.result() is None


def test_a_generate_stream_finished_by_abort_is_a_failure() -> None:
    sn = UsageSniffer("text/event-stream")
    sn.feed(
        b'data: {"text":"x","meta_info":{"id":"r","finish_reason":{"type":"abort","message":"Input length",'
        b'"status_code":400},"prompt_tokens":1,"completion_tokens":1,"cached_tokens":0}}\n\ndata: [DONE]\n\n'
    )
    assert sn.result() is None and sn.errored
    ok = UsageSniffer("text/event-stream")
    ok.feed(
        b'data: {"text":"x","meta_info":{"id":"r","finish_reason":{"type":"length","length":2},'
        b'"prompt_tokens":5,"completion_tokens":2,"cached_tokens":0}}\n\ndata: [DONE]\n\n'
    )
    assert ok.result() == Usage(5, 0, 2) and not ok.errored


def test_the_word_error_in_content_is_no_error_event() -> None:
    sn = UsageSniffer("text/event-stream")
    for chunk in [b'data: {"choices":[{"delta":{"content":"{\\"error\\": 1} and \\"error\\""}}]}\n\n', *_STREAM]:
        sn.feed(chunk)
    assert not sn.errored and sn.result() == Usage(7, 5, 2)


# SGLang 0.5.23's /v1/messages (Anthropic's Messages API), as a real CPU engine streamed it
_MESSAGES_STREAM = [
    (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_e8f9","type":"message",'
        b'"role":"assistant","content":[],"model":"m","usage":{"input_tokens":1,"output_tokens":0,'
        b'"cache_read_input_tokens":49}}}\n\n'
    ),
    (
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":'
        b'{"type":"text","text":""}}\n\n'
    ),
    (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
        b'"text":"say \\"output_tokens\\": 9"}}\n\n'
    ),
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
    (
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
        b'"usage":{"output_tokens":4}}\n\n'
    ),
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]


def test_anthropic_messages_usage_streamed_and_not() -> None:
    """input_tokens excludes what was read from the cache: the prompt is their sum."""
    for feed in ("whole", "bytewise"):
        sn = UsageSniffer("text/event-stream")
        for chunk in _MESSAGES_STREAM:
            if feed == "whole":
                sn.feed(chunk)
            else:
                for b in chunk:
                    sn.feed(bytes([b]))
        assert sn.events == 6 and not sn.errored, feed
        assert sn.result() == Usage(50, 49, 4), feed
    js = UsageSniffer("application/json")
    js.feed(
        b'{"id":"msg_93","type":"message","role":"assistant","content":[{"type":"text","text":"x"}],'
        b'"model":"m","stop_reason":"max_tokens","usage":{"input_tokens":50,"output_tokens":4}}'
    )
    assert js.result() == Usage(50, 0, 4)  # SGLang leaves cache_read_input_tokens out when 0
    cut = UsageSniffer("text/event-stream")  # no message_delta: the output is unknown
    cut.feed(_MESSAGES_STREAM[0])
    assert cut.result() == Usage(50, 49, None)


def test_anthropic_error_event_in_a_200_stream_is_a_failure() -> None:
    sn = UsageSniffer("text/event-stream")
    sn.feed(_MESSAGES_STREAM[0])
    sn.feed(b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n')
    sn.feed(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert sn.errored and sn.result() is None

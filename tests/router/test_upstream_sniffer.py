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


def _fed(chunks: list[bytes], *, bytewise: bool) -> UsageSniffer:
    """An SSE sniffer fed ``chunks`` as they are, or one byte at a time (every line split)."""
    sn = UsageSniffer("text/event-stream")
    for chunk in chunks:
        for piece in [bytes([b]) for b in chunk] if bytewise else [chunk]:
            sn.feed(piece)
    return sn


def test_anthropic_messages_usage_streamed_and_not() -> None:
    """input_tokens excludes what was read from the cache: the prompt is their sum."""
    for feed in ("whole", "bytewise"):
        sn = _fed(_MESSAGES_STREAM, bytewise=feed == "bytewise")
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


# SGLang 0.5.23's /v1/responses (OpenAI's Responses API), as a real CPU engine streamed it (the
# response objects shortened to the fields read)
_RESP = b'"id":"resp_2e0b","object":"response","model":"m","output":[],"max_output_tokens":4'
_RESPONSES_STREAM = [
    b'event: response.created\ndata: {"type":"response.created","response":{' + _RESP + b',"status":"in_progress",'
    b'"usage":null,"error":null},"sequence_number":0}\n\n',
    b'event: response.in_progress\ndata: {"type":"response.in_progress","response":{' + _RESP + b',"status":'
    b'"in_progress","usage":null,"error":null},"sequence_number":1}\n\n',
    (
        b'event: response.output_text.delta\ndata: {"content_index":0,"delta":"say \\"input_tokens\\": 9","item_id":'
        b'"msg_467f","logprobs":[],"output_index":0,"sequence_number":2,"type":"response.output_text.delta"}\n\n'
    ),
    b'event: response.incomplete\ndata: {"type":"response.incomplete","response":{' + _RESP + b',"status":'
    b'"incomplete","usage":{"input_tokens":41,"input_tokens_details":{"cached_tokens":40,"cache_write_tokens":0},'
    b'"output_tokens":2,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":43},"error":null,'
    b'"incomplete_details":{"reason":"max_output_tokens"}},"sequence_number":3}\n\n',
]


def test_responses_usage_streamed_and_not() -> None:
    """input_tokens is the whole prompt (OpenAI's meaning), the cached part in its details; a stream
    carries it in its last event, response.completed or response.incomplete."""
    for feed in ("whole", "bytewise"):
        sn = _fed(_RESPONSES_STREAM, bytewise=feed == "bytewise")
        assert sn.events == 4 and not sn.errored, feed
        assert sn.result() == Usage(41, 40, 2), feed
    completed = UsageSniffer("text/event-stream")
    for chunk in [*_RESPONSES_STREAM[:3], _RESPONSES_STREAM[3].replace(b"response.incomplete", b"response.completed")]:
        completed.feed(chunk)
    assert completed.result() == Usage(41, 40, 2)
    js = UsageSniffer("application/json")
    js.feed(
        b'{"id":"resp_40ae","object":"response","model":"m","output":[],"status":"completed","usage":{"input_tokens"'
        b':41,"input_tokens_details":{"cached_tokens":0,"cache_write_tokens":0},"output_tokens":2,'
        b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":43},"max_output_tokens":4}'
    )
    assert js.result() == Usage(41, 0, 2)
    cut = UsageSniffer("text/event-stream")  # no last event: nothing learnt
    for chunk in _RESPONSES_STREAM[:3]:
        cut.feed(chunk)
    assert cut.result() is None and not cut.errored


def test_responses_failed_event_in_a_200_stream_is_a_failure() -> None:
    """SGLang streams a prompt it refuses as response.failed (usage null) inside a 200."""
    sn = UsageSniffer("text/event-stream")
    for chunk in _RESPONSES_STREAM[:2]:
        sn.feed(chunk)
    sn.feed(
        b'event: response.failed\ndata: {"type":"response.failed","response":{' + _RESP + b',"status":"failed",'
        b'"usage":null,"error":{"code":"server_error","message":"The input (120012 tokens) is longer than the '
        b'model\'s context length (32768 tokens)."}},"sequence_number":2}\n\n'
    )
    assert sn.errored and sn.result() is None

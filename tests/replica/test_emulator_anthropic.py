"""The Anthropic -> chat conversion and request checks (replica/emulator/anthropic.py), as SGLang
0.5.23's ``anthropic/serving.py`` and pydantic do them."""

from __future__ import annotations

from typing import Any

import pytest

from replica.emulator.anthropic import AnthropicRequestError, sse_event, to_chat, usage

U = {"role": "user", "content": "hi"}
TOOL = {"name": "get_weather", "input_schema": {"properties": {}}}
UNION = ("list[tagged-union[TextBlock,ImageBlock,ToolUseBlock,ToolResultBlock,ToolReferenceBlock,SearchResultBlock,"
         "ThinkingBlock,RedactedThinkingBlock]]")


def req(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [U], **kw}


@pytest.mark.parametrize(
    ("body", "messages"),
    [
        (req(), [U]),
        (req(system="  "), [U]),  # a blank system prompt is none
        (req(system="be brief"), [{"role": "system", "content": "be brief"}, U]),
        (req(system=[{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]),
         [{"role": "system", "content": "a\nb"}, U]),
        (req(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]),
         [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]),
        # earlier thinking is dropped (no reasoning parser); tool_use becomes tool_calls
        (req(messages=[U, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]}]),
         [U, {"role": "assistant", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "f", "arguments": '{"a": 1}'}}], "content": "let me look"}]),
        # tool results: text before them stays before, each becomes a tool message
        (req(messages=[{"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]},
            {"type": "text", "text": "thanks"}]}]),
         [{"role": "user", "content": "first"}, {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
          {"role": "tool", "tool_call_id": "t2", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
          {"role": "user", "content": "thanks"}]),
        (req(messages=[U, {"role": "assistant", "content": []}]), [U, {"role": "assistant", "content": ""}]),
    ],
)
def test_messages_convert_as_sglang_does(body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    assert to_chat(body)["messages"] == messages


def test_sampling_fields_and_tools_convert() -> None:
    chat = to_chat(req(stream=True, temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["\n"],
                       metadata={"user_id": "u"}, tools=[TOOL, {"type": "web_search_20250305", "name": "web_search"}]))
    assert chat == {
        "messages": [U], "model": "m", "max_tokens": 8, "stream": True, "temperature": 0.5, "top_p": 0.9,
        "top_k": 5, "stop": ["\n"],
        # the schema gets its object type; the server tool is left out
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {
            "properties": {}, "type": "object"}, "strict": False}}],
        "tool_choice": "auto",
    }
    assert to_chat(req(tools=[TOOL], tool_choice={"type": "any"}))["tool_choice"] == "required"
    assert to_chat(req(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}))["tool_choice"] == {
        "type": "function", "function": {"name": "get_weather"}}
    assert to_chat(req(tool_choice={"type": "none"}))["tool_choice"] == "none"
    assert "tool_choice" not in to_chat(req(tool_choice={"type": "auto"}))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "model: Field required; messages: Field required; max_tokens: Field required"),
        (req(model=""), "model: Value error, Model is required"),
        (req(max_tokens=0), "max_tokens: Value error, max_tokens must be positive"),
        (req(max_tokens=2.5), "max_tokens: Input should be a valid integer, got a number with a fractional part"),
        (req(messages="hi"), "messages: Input should be a valid list"),
        (req(messages=[{"role": "tool", "content": "x"}]),
         "messages.0.role: Input should be 'user', 'assistant' or 'system'"),
        (req(messages=[{"role": "user", "content": [{"type": "text"}]}]),
         f"messages.0.content.str: Input should be a valid string; messages.0.content.{UNION}.0.text.text: Field required"),
        (req(system=5), f"system.str: Input should be a valid string; system.{UNION}: Input should be a valid list"),
        (req(stream="maybe"), "stream: Input should be a valid boolean, unable to interpret input"),
        (req(tools=[{"name": "x"}]), "tools.0.custom.input_schema: Field required"),
        (req(thinking={"type": "enabled"}),
         "thinking: Value error, thinking.budget_tokens is required when thinking.type is 'enabled'"),
        (req(thinking={"type": "adaptive"}), "Anthropic thinking is not supported for models without a reasoning parser"),
        (req(messages=[{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]),
         "Anthropic redacted_thinking history is not supported"),
        (req(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}),
         ("tool_choice references tool 'nope' but it is not in the forwarded tools list "
          "(server-side Anthropic tools cannot be selected)")),
    ],
)
def test_refusals_name_the_problem(body: dict[str, Any], message: str) -> None:
    with pytest.raises(AnthropicRequestError) as exc:
        to_chat(body)
    assert str(exc.value) == message


def test_lax_values_are_taken() -> None:
    assert to_chat(req(max_tokens="7", stream="yes"))["max_tokens"] == 7
    assert to_chat({"model": "m", "messages": [U]}, count_tokens=True)["max_tokens"] == 1
    assert to_chat(req(thinking={"type": "disabled"}))["messages"] == [U]


def test_usage_and_framing() -> None:
    assert usage(10, 0, 3) == {"input_tokens": 10, "output_tokens": 3}
    assert usage(10, 6, 0) == {"input_tokens": 4, "output_tokens": 0, "cache_read_input_tokens": 6}
    assert sse_event({"type": "message_stop"}) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'

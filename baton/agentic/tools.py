"""Tool calls in a model's text, by format name (`agentic.tool_call_parser`), parsed into OpenAI `tool_calls`.

- "hermes" (Hermes, Qwen2.5/3): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the text;
  the text outside the blocks is the message's content.
- "json": the whole reply is one JSON call object, `{"name": ..., "arguments": {...}}`, or a list of them; a reply
  that does not start with `{` or `[` is plain content.

A parser returns (content, calls, errors): `calls` as `{"name": str, "arguments": str}` (arguments JSON-encoded, as
the OpenAI API sends them), `errors` the number of call blocks that were not a JSON object with a string `name` and
object `arguments` (the endpoint counts them, `agent/tool_call_parse_errors`). A malformed block is left out of the
calls and kept in the content, so the agent sees what the model wrote.
"""

from __future__ import annotations

import json
import re
from typing import Callable

ParsedCalls = tuple[str, list[dict[str, str]], int]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _call(obj) -> dict[str, str] | None:
    """One call object as {"name", "arguments"}, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(arguments)}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:  # JSONDecodeError, and a number too large for the int limit
        return None


def parse_hermes(text: str) -> ParsedCalls:
    calls, errors, kept = [], 0, []
    last = 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _call(_loads(match.group(1).strip()))
        kept.append(text[last:match.start()])
        if call is None:
            errors += 1
            kept.append(match.group(0))
        else:
            calls.append(call)
        last = match.end()
    kept.append(text[last:])
    if "<tool_call>" in text[last:]:  # an opened block never closed (the turn ran out of tokens, say)
        errors += 1
    return "".join(kept).strip(), calls, errors


def parse_json(text: str) -> ParsedCalls:
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return text, [], 0
    parsed = _loads(stripped)
    objects = parsed if isinstance(parsed, list) else [parsed]
    calls = [_call(obj) for obj in objects]
    if parsed is None or not objects or any(call is None for call in calls):
        return text, [], 1
    return "", calls, 0


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedCalls]] = {"hermes": parse_hermes, "json": parse_json}


def parse_tool_calls(text: str, parser: str | None) -> ParsedCalls:
    """`text` parsed by the named format (None: no tool calls, the text is the content)."""
    if parser is None:
        return text, [], 0
    return TOOL_CALL_PARSERS[parser](text)


__all__ = ["TOOL_CALL_PARSERS", "parse_hermes", "parse_json", "parse_tool_calls"]

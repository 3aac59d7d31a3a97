"""`AgentEndpoint`: an OpenAI-compatible HTTP endpoint in front of the rollout system's router, which agent programs
call (AReaL's "replace base_url"): `/v1/chat/completions`, `/v1/completions` and `/v1/models`.

Sessions. Each episode is a session; its requests name it by the base URL it was given (`.../s/{session}/v1`), or
else by an `X-Session-Id` header or the body's `user` field. A session's requests keep one engine (its prefix
cache holds the conversation) and run one at a time, in the order they came.

Token in, token out. The endpoint records every token it samples and builds the training sequence from those
tokens, never by tokenizing text the model wrote again (a conversation re-tokenized between turns can change
tokens, and then the trained log-probs are not the sampled ones). A chat request that continues the conversation
(the earlier messages, then the reply the endpoint sent, then new messages) is prompted with the tokens so far
(prompt, sampled replies, and the template's text in between) and the new messages' text tokenized after them; the
reply the agent sends back is taken as what the model sampled, whatever the agent did to its text. The template's
text in between and the new messages get loss mask 0, log-prob 0.0 and weight version -1. A request that does not
continue the conversation (the agent rewrote its history) starts the sequence again (`agent/chain_resets`); the
episode trains on its last one. A completions request continues the sequence when its prompt (token ids, or
text) starts with it.

Sampling is the run's: the request's temperature, top_p, seed and stop are ignored (the trained log-probs are
those of the run's sampling), its max_tokens is honoured up to `max_tokens_per_turn`; a turn stops at eos or the
chat template's end of turn. Each choice carries its reply's `token_ids` (as vLLM's do). Past `max_turns`
requests or `max_tokens` tokens the endpoint answers with no text and finish_reason "length", and the episode is
TRUNCATED.

Security. By default the endpoint listens on loopback and serves only loopback clients. Bound elsewhere it needs a
token, and every request must carry it (`Authorization: Bearer <token>`). A request body is at most 8 MiB; bad
JSON, a message of the wrong shape or an unknown session is answered with a 4xx error naming it. An aborted episode
(the rollout stopping) answers 410 Gone, which the OpenAI client does not retry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from baton.agentic.tools import TOOL_CALL_PARSERS, parse_tool_calls
from baton.config import ConfigError
from baton.engines.protocol import GenerationRequest
from baton.strategy import SamplingParams

MAX_BODY_BYTES = 8 << 20
ROLES = ("system", "developer", "user", "assistant", "tool")
# Stands for one of the endpoint's own replies when a conversation is rendered to find the template's text around it.
_REPLY = "BATON-REPLY-{}-7f3a"


class EndpointError(Exception):
    """An answer with an HTTP error status: (status, message)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def is_loopback(address: str | None) -> bool:
    """Whether `address` (an IP address, or "localhost") is this machine's loopback."""
    if address == "localhost":
        return True
    try:
        return address is not None and ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def check_settings(tool_call_parser: str | None, host: str, token: str | None) -> None:
    """ConfigError for a tool-call parser that is not one, or a host beyond loopback without a token."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(f"agentic.tool_call_parser {tool_call_parser!r} is not one of "
                          f"{sorted(TOOL_CALL_PARSERS)} (or null)")
    if not is_loopback(host) and not token:
        raise ConfigError(f"agentic.endpoint_host {host!r} serves the engines beyond this machine; set "
                          "agentic.endpoint_token (clients send it as their API key), or keep 127.0.0.1")


def text_of(content, where: str) -> str:
    """A message's content as text: a string, None (an assistant message with only tool calls) or a list of text
    parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise EndpointError(400, f"{where}: content must be a string, null or a list of text parts")


def checked_messages(messages) -> list[dict[str, Any]]:
    """The request's messages, each {"role", "content" (text)} plus its tool fields; EndpointError if malformed."""
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise EndpointError(400, f"messages[{i}] must be an object with a role in {ROLES}")
        kept = {key: message[key] for key in ("name", "tool_call_id", "tool_calls") if key in message}
        out.append({"role": message["role"], "content": text_of(message.get("content"), f"messages[{i}]"), **kept})
    return out


@dataclass
class Session:
    """One episode's record: the token sequence (prompt, then replies and what came between), per response token its
    loss mask, log-prob and weight version, and what the next request must continue."""

    key: str
    sample: Any  # the episode's `Sample`
    ctx: Any  # its `RolloutContext`
    params: SamplingParams
    max_turns: int
    max_tokens: int
    max_tokens_per_turn: int
    ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    chain_resets: int = 0
    tool_call_parse_errors: int = 0
    truncated: bool = False
    aborted: bool = False
    # The last chat request's messages (the endpoint's replies among them as _REPLY markers), its prompt's text
    # rendered so, and the text of the stop token its reply ended with ("" if none).
    messages: list[dict] | None = None
    prompt_text: str = ""
    stop_text: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len

    def start(self, prompt_ids: list[int]) -> None:
        """Begin the sequence (again) at this prompt."""
        if self.ids:
            self.chain_resets += 1
        self.ids, self.prompt_len = list(prompt_ids), len(prompt_ids)
        self.mask, self.log_probs, self.versions = [], [], []
        self.messages = None

    def extend(self, ids: list[int], log_probs: list[float] | None = None, versions: list[int] | None = None) -> None:
        """Append tokens: sampled ones (with their log-probs and versions, trained) or others (not trained)."""
        self.ids += ids
        self.mask += [1 if log_probs is not None else 0] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.versions += list(versions) if versions is not None else [-1] * len(ids)


class AgentEndpoint:
    """See the module docstring. `tokenizer` renders and tokenizes (its chat template is checked to round-trip when
    the endpoint is made); `tool_call_parser`: a name in `TOOL_CALL_PARSERS` or None; `host`/`port` (0: a free
    one); `token`: required unless `host` is loopback."""

    def __init__(self, tokenizer, model_name: str = "baton", tool_call_parser: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        check_settings(tool_call_parser, host, token)
        self.tokenizer, self.model_name, self.tool_call_parser = tokenizer, model_name, tool_call_parser
        self.host, self.port, self.token = host, port, token
        self.sessions: dict[str, Session] = {}
        self.stop_ids = self._check_template()
        self._ids = itertools.count()
        self._runner = None

    # --- the chat template --------------------------------------------------------------------------

    def render(self, messages: list[dict], tools, generation: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
                                                      tokenize=False)
        except Exception as error:  # a template that cannot render these messages: the request's problem
            raise EndpointError(400, f"the chat template cannot render these messages: {type(error).__name__}: "
                                     f"{error}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_template(self) -> tuple[int, ...]:
        """The stop token ids: eos and the first token of the template's end of turn. Refuses a tokenizer without a
        chat template, or whose rendered conversations do not survive tokenizing and decoding."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; the agent endpoint renders chat messages with it "
                              "(set one in the tokenizer's directory)")
        probe = [{"role": "system", "content": "You play a game."}, {"role": "user", "content": "Guess: 1 to 9."},
                 {"role": "assistant", "content": _REPLY.format(0)}, {"role": "tool", "content": "higher"}]
        try:
            text = self.render(probe, None, True)
        except EndpointError as error:
            raise ConfigError(f"the tokenizer's chat template: {error.message}") from None
        back = self.tokenizer.decode(self.encode(text), skip_special_tokens=False)
        if back != text:
            at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
            raise ConfigError(f"the tokenizer does not round-trip its chat template's text: at character {at}, "
                              f"{text[at:at + 20]!r} comes back as {back[at:at + 20]!r}; fix the tokenizer or "
                              "its template")
        end_of_turn = self.render(probe[:3], None, False).split(_REPLY.format(0), 1)[1]
        stops = [self.tokenizer.eos_token_id]
        if end_of_turn and (first := self.encode(end_of_turn)[:1]) and first[0] not in stops:
            stops.append(first[0])
        return tuple(stops)

    # --- sessions ---------------------------------------------------------------------------------------

    def open(self, key: str, sample, ctx, params: SamplingParams, max_turns: int, max_tokens: int,
             max_tokens_per_turn: int) -> Session:
        session = Session(key, sample, ctx, params, max_turns, max_tokens, max_tokens_per_turn)
        self.sessions[key] = session
        return session

    def close(self, key: str) -> Session | None:
        return self.sessions.pop(key, None)

    def base_url(self, key: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/s/{key}/v1"

    # --- serving --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen (on the running loop: the rollout system's)."""
        from aiohttp import web

        @web.middleware
        async def guard(request, handler):
            return await self._guard(request, handler)

        app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_get(prefix + "/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _error(self, status: int, message: str, kind: str = "invalid_request_error"):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    async def _guard(self, request, handler):
        """Every request: the token where one is set, else a loopback client only; an EndpointError as its status."""
        if self.token:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return self._error(401, "a valid token is required (send it as the API key)", "authentication_error")
        elif not is_loopback(request.remote):
            return self._error(403, "this endpoint serves loopback clients only (set agentic.endpoint_token to "
                                    "serve others)", "permission_error")
        try:
            return await handler(request)
        except EndpointError as error:
            return self._error(error.status, error.message, error.kind)

    async def _body(self, request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise EndpointError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise EndpointError(400, "the request body must be a JSON object")
        return body

    def _session(self, request, body: dict) -> Session:
        key = request.match_info.get("session") or request.headers.get("X-Session-Id") or body.get("user")
        if not isinstance(key, str) or key not in self.sessions:
            raise EndpointError(404, f"no episode {key!r} is open here (episodes call the base URL they were given)",
                                "not_found_error")
        return self.sessions[key]

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "baton"}]})

    def _max_tokens(self, body: dict) -> int | None:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise EndpointError(400, f"max_tokens must be a positive integer, got {value!r}")
        return value

    # --- chat -------------------------------------------------------------------------------------------

    def _chat_prompt(self, session: Session, messages: list[dict], tools) -> tuple[list[dict], str]:
        """Put the prompt of this chat request on the session's sequence (continuing it where the request continues
        the conversation); the messages with the endpoint's replies marked, and the prompt's text rendered so."""
        previous = session.messages
        if previous is not None and len(messages) > len(previous) and messages[len(previous)]["role"] == "assistant" \
                and all(_same(a, b) for a, b in zip(previous, messages)):
            marked = previous + [{"role": "assistant", "content": _REPLY.format(session.calls)}]
            through = self.render(marked, tools, False)
            rest = marked + messages[len(marked):]
            text = self.render(rest, tools, True)
            before, _, after = through.rpartition(_REPLY.format(session.calls))
            if before == session.prompt_text and text.startswith(through):
                tail = after[len(session.stop_text):] if after.startswith(session.stop_text) else after
                session.extend(self.encode(tail + text[len(through):]))
                return rest, text
        text = self.render(messages, tools, True)
        session.start(self.encode(text))
        return messages, text

    async def _chat(self, request):
        body = await self._body(request)
        session = self._session(request, body)
        messages, tools = checked_messages(body.get("messages")), body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise EndpointError(400, "tools must be a list")
        max_tokens = self._max_tokens(body)
        async with session.lock:
            if session.truncated:  # the episode's turns or tokens are spent: its sequence grows no more
                return self._reply(session, "chat.completion", {"message": {"role": "assistant", "content": ""},
                                                                "finish_reason": "length"}, [])
            marked, text = self._chat_prompt(session, messages, tools)
            ids, finish = await self._generate(session, max_tokens)
            stop = ids[-1:] if finish == "stop" and ids and ids[-1] in self.stop_ids else []
            session.messages, session.prompt_text = marked, text
            session.stop_text = self.tokenizer.decode(stop, skip_special_tokens=False) if stop else ""
            reply = self.tokenizer.decode(ids[:len(ids) - len(stop)], skip_special_tokens=True)
            content, calls, errors = parse_tool_calls(reply, self.tool_call_parser)
            session.tool_call_parse_errors += errors
            number = session.calls
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [{"id": f"call_{session.key}_{number}_{i}", "type": "function", "function": call}
                                     for i, call in enumerate(calls)]
            finish = "tool_calls" if finish == "stop" else finish
        return self._reply(session, "chat.completion", {"message": message, "finish_reason": finish}, ids)

    def _reply(self, session: Session, kind: str, choice: dict, ids: list[int]):
        """A chat.completion or text_completion answer of one choice (its reply's `token_ids` in it)."""
        from aiohttp import web

        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return web.json_response({
            "id": f"{prefix}-{next(self._ids)}", "object": kind, "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, **choice, "logprobs": None, "token_ids": ids}],
            "usage": {"prompt_tokens": len(session.ids) - len(ids), "completion_tokens": len(ids),
                      "total_tokens": len(session.ids)}})

    # --- completions ------------------------------------------------------------------------------------

    async def _completions(self, request):
        body = await self._body(request)
        session = self._session(request, body)
        prompt = body.get("prompt")
        max_tokens = self._max_tokens(body)
        async with session.lock:
            if session.truncated:
                return self._reply(session, "text_completion", {"text": "", "finish_reason": "length"}, [])
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
                vocab = len(self.tokenizer)
                if not all(0 <= t < vocab for t in prompt):
                    raise EndpointError(400, f"prompt token ids must be in [0, {vocab})")
                ids = list(prompt)
            elif isinstance(prompt, str) and prompt:
                known = self.tokenizer.decode(session.ids, skip_special_tokens=False) if session.ids else None
                ids = session.ids + self.encode(prompt[len(known):]) if known and prompt.startswith(known) \
                    else self.encode(prompt)
            else:
                raise EndpointError(400, "prompt must be a non-empty string or list of token ids")
            if session.ids and ids[:len(session.ids)] == session.ids:
                session.extend(ids[len(session.ids):])
            else:
                session.start(ids)
            session.messages = None  # a chat request after this starts again
            out, finish = await self._generate(session, max_tokens)
            text = self.tokenizer.decode(out, skip_special_tokens=True)
        return self._reply(session, "text_completion", {"text": text, "finish_reason": finish}, out)

    # --- generation -------------------------------------------------------------------------------------

    async def _generate(self, session: Session, max_tokens: int | None) -> tuple[list[int], str]:
        """Sample the next reply on the session's sequence and append it (trained); (its ids, finish_reason).
        Past the episode's turns or tokens: nothing, "length"."""
        budget = min(session.max_tokens_per_turn, session.max_tokens - session.response_len)
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        if session.calls >= session.max_turns or budget < 1:
            session.truncated = True  # the text this request added after the last reply is not kept either
            while session.mask and session.mask[-1] == 0:  # (every sampled token has mask 1)
                for column in (session.ids, session.mask, session.log_probs, session.versions):
                    column.pop()
            return [], "length"
        sample = session.sample
        seed = None if sample.seed is None else (sample.seed + session.calls) % (1 << 62)
        params = dataclasses.replace(session.params, n=1, seed=seed, stop_token_ids=self.stop_ids,
                                     max_new_tokens=budget)
        request = GenerationRequest(session.ctx.request_id(sample), tuple(session.ids), params)
        try:
            result = await session.ctx.generate_request(request, affinity_key=session.key)
        except ValueError as error:  # the engine's refusal of this request (a prompt past its context, say)
            raise EndpointError(400, f"the engine refused the request: {error}") from None
        if result.finish_reason == "abort":
            session.aborted = True
            raise EndpointError(410, "the episode was aborted (the rollout stopped); end the agent program",
                                "episode_aborted")
        session.calls += 1
        session.extend(list(result.response_ids), list(result.log_probs), list(result.weight_versions))
        return list(result.response_ids), result.finish_reason


def _same(a: dict, b: dict) -> bool:
    """Whether message `b` repeats `a` (one of the endpoint's replies, marked in `a`, repeats any assistant message)."""
    if a["role"] != b["role"]:
        return False
    if a["role"] == "assistant" and a["content"].startswith(_REPLY.split("{")[0]):
        return True
    return a["content"] == b["content"] and json.dumps(a.get("tool_calls"), sort_keys=True) == \
        json.dumps(b.get("tool_calls"), sort_keys=True)


__all__ = ["AgentEndpoint", "EndpointError", "MAX_BODY_BYTES", "Session", "check_settings", "checked_messages",
           "is_loopback"]

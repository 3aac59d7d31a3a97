"""Agent programs through the OpenAI-compatible endpoint (`baton.agentic.endpoint`, `baton.agentic.agent`): tool-call
parsing in two formats, the endpoint's token-in/token-out record of a conversation (against a scripted engine),
its refusals, and agents written against the `openai` client alone trained end to end, in sync and async modes, on
the local backend and on Ray, on exactly the tokens they were sampled."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json

import aiohttp
import pytest
import torch

from baton.agentic.endpoint import AgentEndpoint
from baton.agentic.rollout import AgenticSettings
from baton.agentic.tools import parse_hermes, parse_json
from baton.config import ConfigError
from baton.engines.protocol import GenerationResult
from baton.models import load_tokenizer
from baton.pipelines.agentic import AgenticConfig, AgenticPipeline
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import RoleConfig, SamplingConfig, TrainerConfig
from baton.rollout import Sample
from baton.rollout.config import RolloutSystemConfig
from baton.rollout.dump import load_rollout
from baton.strategy import SamplingParams, StrategyConfig
from baton.tracking import run_metrics

AGENTS = "openai_agents"  # tests/ is on sys.path: the agent programs are importable by path


# --- tool calls -------------------------------------------------------------------------------------------

def test_hermes_tool_calls_are_parsed_and_a_malformed_block_is_counted_and_kept():
    text = ('Let me add.<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": "not json"}</tool_call>')
    content, calls, errors = parse_hermes(text)
    assert calls == [{"name": "calc", "arguments": '{"expression": "2+3"}'}] and errors == 1
    assert content.startswith("Let me add.") and "not json" in content  # the agent sees what the model wrote
    assert parse_hermes("no calls here") == ("no calls here", [], 0)
    assert parse_hermes('<tool_call>{"name": "calc", "argu')[2] == 1  # cut off before it closed


def test_json_tool_calls_are_parsed_and_plain_text_is_content():
    assert parse_json('{"name": "calc", "arguments": {"x": 1}}') == ("", [{"name": "calc", "arguments": '{"x": 1}'}],
                                                                     0)
    assert parse_json('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]')[1] == [
        {"name": "a", "arguments": "{}"}, {"name": "b", "arguments": "{}"}]
    assert parse_json("the answer is 5") == ("the answer is 5", [], 0)
    assert parse_json('{"name": 3}') == ('{"name": 3}', [], 1)
    assert parse_json("{broken") == ("{broken", [], 1)


# --- the endpoint, against a scripted engine --------------------------------------------------------------

class ScriptedContext:
    """A `RolloutContext` stand-in whose engine answers each request with the next scripted token ids ("abort":
    an aborted request)."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []

    def request_id(self, sample) -> str:
        return f"r{len(self.requests)}"

    async def generate_request(self, request, affinity_key=None):
        self.requests.append((request, affinity_key))
        ids = self.replies.pop(0)
        if ids == "abort":
            return GenerationResult(request.request_id, (), (), (), 3, "abort")
        finish = "stop" if ids[-1] in request.params.stop_token_ids else "length"
        return GenerationResult(request.request_id, tuple(ids), tuple([-0.5] * len(ids)), tuple([3] * len(ids)), 3,
                                finish)


def serve(replies, script, max_turns=4, max_tokens=64, **endpoint_kwargs):
    """Run `script(endpoint, session, http, url)` against an endpoint serving one episode on a scripted engine."""
    tokenizer = load_tokenizer()

    async def main():
        endpoint = AgentEndpoint(tokenizer, **endpoint_kwargs)
        await endpoint.start()
        sample = Sample(group_index=0, sample_index=0, prompt="", prompt_ids=[], seed=11)
        session = endpoint.open("ep", sample, ScriptedContext(replies), SamplingParams(temperature=1.0),
                                max_turns, max_tokens, 6)
        try:
            async with aiohttp.ClientSession() as http:
                return await script(endpoint, session, http, endpoint.base_url("ep"))
        finally:
            await endpoint.stop()

    return asyncio.run(main())


async def chat(http, url, messages, **body):
    async with http.post(f"{url}/chat/completions", json={"model": "m", "messages": messages, **body}) as reply:
        return reply.status, await reply.json()


def test_a_conversation_trains_on_its_sampled_tokens_where_its_text_would_tokenize_otherwise():
    """Turn 1's reply holds a <bos> the reply's text cannot show, turn 2's ends with eos where the template ends a
    turn with a newline. The sequence holds the sampled tokens (loss mask 1) and the template's text between them
    (mask 0), where rendering the conversation and tokenizing it gives other tokens."""
    tokenizer = load_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    newline, eos, bos = encode("\n")[0], tokenizer.eos_token_id, tokenizer.bos_token_id
    first, second = [*encode("5"), bos, newline], [*encode("7"), eos]

    async def script(endpoint, session, http, url):
        messages = [{"role": "user", "content": "guess 1-8"}]
        status, one = await chat(http, url, messages)
        assert status == 200 and one["choices"][0]["message"]["content"] == "5"  # <bos> and the stop token left out
        assert one["choices"][0]["token_ids"] == first and one["choices"][0]["finish_reason"] == "stop"
        messages += [{"role": "assistant", "content": "5"}, {"role": "user", "content": "higher"}]
        status, two = await chat(http, url, messages)
        assert status == 200 and two["choices"][0]["message"]["content"] == "7"
        messages += [{"role": "assistant", "content": "7"}]
        return session, messages, endpoint

    session, messages, endpoint = serve([first, second], script)
    prompt = encode("user: guess 1-8\nassistant: ")
    between = encode("user: higher\nassistant: ")
    assert session.ids == prompt + first + between + second
    assert session.mask == [1] * len(first) + [0] * len(between) + [1] * len(second)
    assert session.versions == [3] * len(first) + [-1] * len(between) + [3] * len(second)
    assert session.log_probs == [-0.5] * len(first) + [0.0] * len(between) + [-0.5] * len(second)
    retokenized = encode(endpoint.render(messages, None, False))
    assert retokenized != session.ids[:len(retokenized)]  # what re-tokenizing would have trained on
    assert session.calls == 2 and session.chain_resets == 0


def test_a_rewritten_history_starts_the_sequence_again_and_the_budget_ends_the_episode():
    tokenizer = load_tokenizer()
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"][0]

    async def script(endpoint, session, http, url):
        await chat(http, url, [{"role": "system", "content": "one"}, {"role": "user", "content": "a"}])
        await chat(http, url, [{"role": "system", "content": "two"}, {"role": "user", "content": "b"}])
        assert session.chain_resets == 1 and session.ids[:len("system: two")] == \
            tokenizer("system: two", add_special_tokens=False)["input_ids"]
        status, third = await chat(http, url, [{"role": "user", "content": "c"}])  # past max_turns=2
        assert status == 200 and third["choices"][0] == {**third["choices"][0], "finish_reason": "length",
                                                         "token_ids": []}
        return session

    session = serve([[newline], [newline]], script, max_turns=2)
    assert session.truncated and session.calls == 2


def test_the_endpoint_answers_bad_requests_an_unknown_episode_and_an_abort_with_errors():
    async def script(endpoint, session, http, url):
        statuses = []
        async with http.post(f"{url}/chat/completions", data=b"{not json") as reply:
            statuses.append(reply.status)
        statuses.append((await chat(http, url, [{"role": "wizard", "content": "x"}]))[0])
        statuses.append((await chat(http, url, [{"role": "user", "content": "x"}], max_tokens=0))[0])
        other = url.replace("/s/ep/", "/s/nobody/")
        statuses.append((await chat(http, other, [{"role": "user", "content": "x"}]))[0])
        status, body = await chat(http, url, [{"role": "user", "content": "x"}])
        statuses.append(status)
        async with http.get(f"{url}/models") as reply:
            statuses.append(reply.status)
        return statuses, body, session

    statuses, body, session = serve(["abort"], script)
    assert statuses == [400, 400, 400, 404, 410, 200] and session.aborted
    assert "aborted" in body["error"]["message"]


def test_completions_continue_the_sequence_from_token_ids_or_text():
    tokenizer = load_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    newline = encode("\n")[0]

    async def script(endpoint, session, http, url):
        replies = []
        for prompt in (encode("1+2="), None, "something else"):
            if prompt is None:  # the sequence so far, as text, and more after it
                prompt = tokenizer.decode(session.ids, skip_special_tokens=False) + "ok?"
            async with http.post(f"{url}/completions", json={"model": "m", "prompt": prompt}) as reply:
                replies.append((reply.status, await reply.json(), list(session.ids), list(session.mask)))
        return session, replies

    session, replies = serve([encode("3") + [newline], encode("y") + [newline], encode("z")], script)
    assert [reply[0] for reply in replies] == [200, 200, 200]
    assert replies[0][1]["choices"][0]["token_ids"] == encode("3") + [newline]
    continued = encode("1+2=") + encode("3") + [newline] + encode("ok?") + encode("y") + [newline]
    assert replies[1][2] == continued and replies[1][3] == [1, 1, 0, 0, 0, 1, 1]
    assert session.chain_resets == 1 and session.ids == encode("something else") + encode("z")
    assert session.mask == [1]


def test_a_chat_template_that_does_not_round_trip_is_refused_where_it_differs():
    tokenizer = load_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} \u2192 {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match=r"does not round-trip its chat template's text: at character 7"):
        AgentEndpoint(tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        AgentEndpoint(tokenizer)


def test_the_endpoint_serves_loopback_only_unless_it_has_a_token():
    with pytest.raises(ValueError, match="set agentic.endpoint_token"):
        AgenticSettings(agent=f"{AGENTS}:guess_number", endpoint_host="0.0.0.0")
    with pytest.raises(ConfigError, match="set agentic.endpoint_token"):
        AgentEndpoint(load_tokenizer(), host="0.0.0.0")

    async def guarded(endpoint, remote, headers):
        from aiohttp.test_utils import make_mocked_request

        request = make_mocked_request("POST", "/v1/models", headers=headers,
                                      transport=_Transport(remote))

        async def handler(_):
            return aiohttp.web.json_response({}, status=200)

        return (await endpoint._guard(request, handler)).status

    async def script(endpoint, session, http, url):
        return [await guarded(endpoint, "10.1.2.3", {}), await guarded(endpoint, "127.0.0.1", {})]

    assert serve([], script) == [403, 200]  # no token: a client elsewhere is refused

    async def with_token(endpoint, session, http, url):
        statuses = [await guarded(endpoint, "10.1.2.3", {}),
                    await guarded(endpoint, "10.1.2.3", {"Authorization": "Bearer wrong"}),
                    await guarded(endpoint, "10.1.2.3", {"Authorization": "Bearer s3cret"})]
        async with http.get(f"{url}/models") as reply:  # over the network, without the token
            statuses.append(reply.status)
        async with http.get(f"{url}/models", headers={"Authorization": "Bearer s3cret"}) as reply:
            statuses.append(reply.status)
        return statuses

    assert serve([], with_token, token="s3cret") == [401, 401, 200, 401, 200]


class _Transport:
    def __init__(self, remote: str):
        self.remote = remote

    def get_extra_info(self, name, default=None):
        return (self.remote, 40000) if name == "peername" else default


# --- agents trained end to end ------------------------------------------------------------------------------

def agent_config(run_dir, agent="guess_number", num_steps=2, model="tiny-qwen2", mode="sync", **agent_kwargs):
    return AgenticConfig(
        actor=RoleConfig(strategy=StrategyConfig(model=model)),
        rollout=RoleConfig(strategy=StrategyConfig(model=model), world_size=1),
        sampling=SamplingConfig(num_samples_per_prompt=2),
        trainer=TrainerConfig(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, num_steps=num_steps,
                              val_every_steps=num_steps, save_every_steps=num_steps, progress_bar=False),
        agentic=AgenticSettings(agent=f"{AGENTS}:{agent}", agent_kwargs=agent_kwargs, max_turns=4, max_tokens=128,
                                num_train_episodes=32, num_val_episodes=4, num_env_processes=1),
        rollout_system=RolloutSystemConfig(mode=mode, save_rollouts=str(run_dir / "rollouts" / "{rollout_id}.jsonl")))


def trained_tokens(sample: Sample) -> list[int]:
    return [t for t, m in zip(sample.response_ids, sample.effective_loss_mask()) if m]


def check_episodes_trained_on_their_sampled_tokens(run_dir, log_dir, rollout_ids) -> list[dict]:
    """Every saved episode's trained tokens are exactly the token ids the endpoint returned to its agent, turn by
    turn; the episodes' logs."""
    logs = {}
    for path in glob.glob(str(log_dir / "episode-*.json")):
        with open(path) as f:
            logs[path.rsplit("episode-", 1)[1][:-len(".json")]] = json.load(f)
    checked = []
    for rollout_id in rollout_ids:
        for group in load_rollout(str(run_dir / "rollouts" / "{rollout_id}.jsonl"), rollout_id):
            for sample in group:
                log = logs[f"{sample.metadata['env_seed']}-{sample.seed}"]
                assert trained_tokens(sample) == [t for reply in log["replies"] for t in reply["token_ids"]]
                turns = sum(bool(reply["token_ids"]) for reply in log["replies"])  # past the budget: no tokens
                assert sample.metadata["trajectory_reward"]["turns"] == turns
                checked.append(log)
    return checked


def test_an_openai_sdk_agent_trains_through_the_endpoint_on_its_sampled_tokens(tmp_path):
    """On the local backend, in sync mode (on Ray, in sync and async modes: the test after the next)."""
    log_dir = tmp_path / "episodes"
    log_dir.mkdir()
    run_pipeline(AgenticPipeline, agent_config(tmp_path / "run", log_dir=str(log_dir)))
    steps = run_metrics(str(tmp_path / "run"))
    assert sorted(steps) == [0, 1, 2]
    for step in (1, 2):
        assert steps[step]["rollout/num_groups"] == 4 and steps[step]["agentic/turns/mean"] >= 1
        assert "actor/pg_loss" in steps[step] and steps[step]["agent/tool_call_parse_errors"] == 0
    episodes = check_episodes_trained_on_their_sampled_tokens(tmp_path / "run", log_dir, (1, 2))
    assert len(episodes) == 16 and any(len(e["replies"]) > 1 for e in episodes)


def model_that_writes_bos(directory) -> str:
    """The tiny model, saved with its <bos> logit raised: its replies hold <bos> tokens, which their text (special
    tokens skipped) does not show, so a conversation rendered from the text and tokenized loses them."""
    from baton.models.build import build_model

    tokenizer, model = load_tokenizer(), build_model("tiny-qwen2", seed=0)
    with torch.no_grad():
        ids = tokenizer(["guess 1-8"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        mean = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[tokenizer.bos_token_id] = 0.3 * mean / mean.norm()
    model.save_pretrained(directory)
    return str(directory)


def test_episodes_whose_text_loses_tokens_train_on_the_sampled_ones(tmp_path):
    log_dir = tmp_path / "episodes"
    log_dir.mkdir()
    config = agent_config(tmp_path / "run", num_steps=1, model=model_that_writes_bos(tmp_path / "model"),
                          log_dir=str(log_dir))
    run_pipeline(AgenticPipeline, config)
    episodes = check_episodes_trained_on_their_sampled_tokens(tmp_path / "run", log_dir, (1,))
    bos = load_tokenizer().bos_token_id
    assert sum(bos in reply["token_ids"] for e in episodes for reply in e["replies"]) > 0
    tokenizer = load_tokenizer()
    [group, *_] = load_rollout(str(tmp_path / "run" / "rollouts" / "{rollout_id}.jsonl"), 1)
    differs = 0
    for sample in (s for g in load_rollout(str(tmp_path / "run" / "rollouts" / "{rollout_id}.jsonl"), 1) for s in g):
        log = json.load(open(log_dir / f"episode-{sample.metadata['env_seed']}-{sample.seed}.json"))
        text = tokenizer.apply_chat_template(log["messages"], tokenize=False)
        differs += tokenizer(text, add_special_tokens=False)["input_ids"] != sample.prompt_ids + sample.response_ids
    assert differs > 0  # re-tokenizing these conversations would have trained on other tokens


def test_an_agent_that_raises_or_rewrites_its_history_costs_only_its_episode(tmp_path):
    run_pipeline(AgenticPipeline, agent_config(tmp_path, agent="misbehaves", num_steps=1))
    record = run_metrics(str(tmp_path))[1]
    assert record["rollout/num_dropped/failed_samples"] > 0 and "actor/pg_loss" in record
    assert record["agent/chain_resets"] > 0 and record["critic/score/mean"] == 0.5  # what trained: even seeds


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_openai_sdk_agent_trains_through_the_endpoint_on_ray(tmp_path, ray_cluster, mode):
    log_dir = tmp_path / "episodes"
    log_dir.mkdir()
    config = agent_config(tmp_path / "run", mode=mode, log_dir=str(log_dir))
    config.trainer = dataclasses.replace(config.trainer, backend="ray", num_nodes=1)
    run_pipeline(AgenticPipeline, config)
    assert sorted(run_metrics(str(tmp_path / "run"))) == [0, 1, 2]
    assert len(check_episodes_trained_on_their_sampled_tokens(tmp_path / "run", log_dir, (1, 2))) == 16

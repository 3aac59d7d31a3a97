"""The user's functions (a reward, an environment, the rollout system's plug-ins) checked by their signatures before
Ray starts, and the user's own field names in the messages about their data."""

from __future__ import annotations

import itertools

import pytest

from baton.cli import main

_NAMES = itertools.count()


def own_task(tmp_path, reward_source: str, *settings: str) -> list[str]:
    """`baton config` arguments for an RLVR run on a task with its own field names (question, solution, level) and
    the reward `reward_source` (a module written beside the config, under a name of its own)."""
    module = f"userreward{next(_NAMES)}"
    (tmp_path / f"{module}.py").write_text(reward_source)
    rows = "".join(f'{{"question": "{a}+{a}=", "solution": "{2 * a}", "level": {a % 3}}}\n' for a in range(8))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "config.yaml").write_text(
        "pipeline_cls: baton.pipelines.rlvr:RLVRPipeline\n"
        f"reward_fn: {module}:score\n"
        "data: {task: files, train_path: train.jsonl, prompt_key: question, answer_key: solution}\n"
        f"trainer: {{backend: local, num_prompts_per_step: 4, run_dir: {tmp_path / 'run'}}}\n")
    return ["config", str(tmp_path / "config.yaml"), *settings]


def importable(tmp_path, monkeypatch, prefix: str, source: str) -> str:
    """`source` as a module of a fresh name starting with `prefix`, importable for this test; its name."""
    module = f"{prefix}{next(_NAMES)}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


def refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("source, problem", [
    ("def score(response, answer):\n    return 0.0\n",
     "reward function '{module}:score' takes no parameter 'finish_reason', 'level', 'prompt', 'uid'"),
    ("def score(response, ground_truth, question, **fields):\n    return 0.0\n",
     "cannot be called on a row: missing a required argument: 'question' (the data's 'question' field reaches the "
     "reward as 'prompt')"),
    ("def score(response, ground_truth, solution, **fields):\n    return 0.0\n",
     "missing a required argument: 'solution' (the data's 'solution' field reaches the reward as its second argument"),
    ("def score(response, **fields):\n    return 0.0\n", "cannot be called on a row: too many positional arguments"),
])
def test_a_reward_whose_signature_does_not_fit_its_rows_is_refused_before_ray_naming_what_it_gets(
        tmp_path, capsys, source, problem):
    err = refusal(capsys, own_task(tmp_path, source))
    module = err.split("reward function '")[1].split(":")[0]
    assert problem.format(module=module) in err
    # what reaches it, under which names, and the fix
    assert ("It is called on each row as score(response, ground_truth, **fields): the decoded response, the data's "
            "'solution' field (data.answer_key), then by keyword prompt (the prompt text, the data's 'question' field, "
            "data.prompt_key), uid, finish_reason, and the data's other fields 'level'; write it as "
            "def score(response, ground_truth, **fields) and read what it needs from fields") in err
    assert "add **fields" not in err  # the fix is said once, at the end
    assert not (tmp_path / "run").exists()


def test_a_misfit_rlvr_reward_in_a_two_stage_run_is_refused_before_sft_starts(tmp_path, capsys):
    import os
    import shutil

    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "reverse")
    module = f"userreward{next(_NAMES)}"
    (tmp_path / f"{module}.py").write_text("def score(completion, answer):\n    return 0.0\n")
    shutil.copy(os.path.join(example, "revreward.py"), tmp_path)  # the sft stage's reward
    (tmp_path / "config.yaml").write_text((open(os.path.join(example, "config.yaml")).read())
                                          .replace("train.jsonl", os.path.join(example, "train.jsonl"))
                                          .replace("val.jsonl", os.path.join(example, "val.jsonl")))
    err = refusal(capsys, ["run", str(tmp_path / "config.yaml"), f"rlvr.reward_fn={module}:score",
                           f"run_dir={tmp_path / 'run'}"])
    assert f"rlvr stage: reward_fn: reward function '{module}:score' takes no parameter" in err
    assert "resume=latest" not in err and not (tmp_path / "run").exists()  # SFT never started


@pytest.mark.parametrize("source", [
    "def score(response, ground_truth, **fields):\n    return float(response == ground_truth)\n",
    "def score(response, ground_truth, level, prompt, uid, finish_reason):\n    return 0.0\n",
    "def score(response, ground_truth, level=0, **fields):\n    return 0.0\n",
    "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
])
def test_a_reward_that_fits_its_rows_passes(tmp_path, capsys, source):
    code = main(own_task(tmp_path, source))
    err = capsys.readouterr().err
    if "level=0" in source:  # a keyword with a default is a setting, which no data field may set
        assert code == 2 and "the data field 'level' has the name of reward function" in err
    else:
        assert code == 0, err


def test_the_rollout_systems_reward_is_checked_against_what_it_gets_there(tmp_path, capsys):
    rollout = ["pipeline_cls=baton.pipelines.rollout_rlvr:RolloutRLVRPipeline"]
    # the prompt and the row's own fields, no uid or finish_reason
    code = main(own_task(tmp_path, "def score(response, ground_truth, prompt, level):\n    return 0.0\n", *rollout))
    err = capsys.readouterr().err
    assert code == 0, err
    err = refusal(capsys, own_task(tmp_path, "def score(response, ground_truth, uid, **fields):\n    return 0.0\n",
                                   *rollout))
    assert "missing a required argument: 'uid'" in err and "then by keyword prompt (the prompt text" in err


def test_a_verl_style_reward_missing_a_parameter_is_refused_with_verls_call(tmp_path, capsys):
    err = refusal(capsys, own_task(tmp_path, "def score(data_source, solution_str, ground_truth):\n    return 0.0\n"))
    assert "it takes no parameter 'extra_info'" in err
    assert "called as verl calls compute_score: data_source= the row's 'data_source' field" in err


def test_the_bad_json_message_names_the_datas_own_fields(tmp_path, capsys):
    argv = own_task(tmp_path, "def score(response, ground_truth, **fields):\n    return 0.0\n")
    (tmp_path / "train.jsonl").write_text('{"question": "1+1=", "solution": "2"}\n{"question": "2+2=" "solution"}\n')
    err = refusal(capsys, argv)
    assert 'train.jsonl, line 2: not valid JSON' in err
    assert 'each line must hold one JSON object such as {"question": "...", "solution": "..."}' in err
    (tmp_path / "train.jsonl").write_text("\n")
    assert '(a .jsonl file: one JSON object per line, such as {"question": "...", "solution": "..."})' in refusal(
        capsys, argv)


ENV_SOURCE = '''
class Fits:
    def __init__(self, high=8):
        self.high = high
    def reset(self, seed):
        return "go"
    def step(self, action):
        return "", 1.0, True, {}

class ResetWithoutSeed(Fits):
    def reset(self):
        return "go"

class StepTakesTwo(Fits):
    def step(self, action, state):
        return "", 1.0, True, {}

class NoStep:
    def reset(self, seed):
        return "go"

def make(high=8):
    return Fits(high)
'''


@pytest.mark.parametrize("env, kwargs, message", [
    ("Fits", {}, None),
    ("Fits", {"high": 4}, None),
    ("make", {"high": 4}, None),
    ("Fits", {"hihg": 4}, "agentic.env '{module}:Fits': Fits(high=8) cannot be called as factory(**agentic.env_kwargs): "
                          "got an unexpected keyword argument 'hihg'"),
    ("make", {"hihg": 4}, "make(high=8) cannot be called as factory(**agentic.env_kwargs)"),
    ("ResetWithoutSeed", {}, "ResetWithoutSeed.reset(self) cannot be called as reset(seed): too many positional "
                             "arguments; give it that signature"),
    ("StepTakesTwo", {}, "StepTakesTwo.step(self, action, state) cannot be called as step(action): missing a required "
                         "argument: 'state'"),
    ("NoStep", {}, "NoStep has no step() method; an environment has reset(seed) -> observation and step(action)"),
])
def test_an_environment_is_checked_by_its_signatures_when_the_config_is_read(tmp_path, monkeypatch, env, kwargs,
                                                                              message):
    from baton.agentic.rollout import AgenticSettings
    from baton.config import ConfigError

    module = importable(tmp_path, monkeypatch, "userenv", ENV_SOURCE)
    if message is None:
        AgenticSettings(env=f"{module}:{env}", env_kwargs=kwargs)
    else:
        with pytest.raises(ConfigError) as info:
            AgenticSettings(env=f"{module}:{env}", env_kwargs=kwargs)
        assert message.format(module=module) in str(info.value)


PLUGIN_SOURCE = '''
def reward_fits(args, sample):
    return 1.0

def reward_one_arg(sample):
    return 1.0

async def generate_fits(args, sample, params):
    return sample

async def generate_no_params(args, sample):
    return sample

def rollout_fits(args, rollout_id, data_source, evaluation=False):
    return []

def rollout_without_evaluation(args, rollout_id, data_source):
    return []

def keep_all(args, group):
    return True
'''


@pytest.mark.parametrize("setting, fn, message", [
    ("reward_function", "reward_fits", None),
    ("generate_function", "generate_fits", None),
    ("rollout_function", "rollout_fits", None),
    ("dynamic_filter", "keep_all", None),
    ("reward_function", "reward_one_arg", "rollout_system.reward_function '{module}:reward_one_arg': "
                                          "reward_one_arg(sample) cannot be called as fn(args, sample): too many "
                                          "positional arguments; give it that signature"),
    ("generate_function", "generate_no_params", "cannot be called as fn(args, sample, params): too many positional"),
    ("rollout_function", "rollout_without_evaluation", "cannot be called as fn(args, rollout_id, data_source, "
                                                        "evaluation)"),
    ("eval_function", "keep_all", "keep_all(args, group) cannot be called as fn(args, rollout_id, data_sources, "
                                  "evaluation)"),
])
def test_a_rollout_plug_in_is_checked_by_its_signature_when_the_config_is_read(tmp_path, monkeypatch, setting, fn,
                                                                                message):
    from baton.config import ConfigError
    from baton.rollout.config import RolloutSystemConfig

    module = importable(tmp_path, monkeypatch, "userplugins", PLUGIN_SOURCE)
    if message is None:
        RolloutSystemConfig(**{setting: f"{module}:{fn}"})
    else:
        with pytest.raises(ConfigError) as info:
            RolloutSystemConfig(**{setting: f"{module}:{fn}"})
        assert message.format(module=module) in str(info.value)

"""Hostile run directories and configs (issue 32, Why 4 and 10), as a user meets them: the `baton` command in a
subprocess. A run directory is data: `baton eval` / `baton generate` import nothing from it or its recorded
directories unless `--trust-run-dir`. A bad config or data file is one line naming the file and the key or line,
with no traceback and no hang, and `baton config` writes nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from baton.config import ConfigError, dump_yaml, load_yaml
from baton.config import paths
from baton.config.loader import parse_yaml
from baton.pipelines.config import DataConfig, SamplingConfig, SFTConfig

BATON = os.path.join(os.path.dirname(sys.executable), "baton")
TIME_LIMIT_S = 60  # each command; the slowest case takes a few seconds


def baton(*argv, cwd, timeout=TIME_LIMIT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    return subprocess.run([BATON, *argv], cwd=cwd, env=env, capture_output=True, timeout=timeout)


def planted(marker_dir, name: str) -> str:
    """A module that leaves a marker file named `name` in `marker_dir` when it is imported."""
    return f"open({str(marker_dir / name)!r}, 'w').close()\n"


# --- run directories are data unless trusted ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """A run directory whose config names a reward module that lies beside it, with a planted resource.py and
    psutil.py there and in a directory its import_dirs.txt records; each writes a marker when imported."""
    from baton.models import build_model

    root = tmp_path_factory.mktemp("planted")
    run_dir, recorded, markers = root / "run", root / "recorded", root / "markers"
    for d in (run_dir, recorded, markers):
        d.mkdir()
    for d in (run_dir, recorded):
        for name in ("resource", "psutil"):
            (d / f"{name}.py").write_text(planted(markers, f"{name}-from-{d.name}"))
    (run_dir / "planted_reward.py").write_text(planted(markers, "planted_reward")
                                              + "def score(response, ground_truth, **fields):\n    return 0.5\n")
    config = SFTConfig(data=DataConfig(max_operand=4, num_val_examples=4),
                       val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=2, num_samples_per_prompt=1))
    text = dump_yaml(config)
    assert "reward_fn: exact_match\n" in text
    (run_dir / "config.yaml").write_text(text.replace("reward_fn: exact_match\n", "reward_fn: planted_reward:score\n"))
    (run_dir / paths.IMPORT_DIRS_FILE).write_text(f"{run_dir}\n{recorded}\n")
    actor = run_dir / "checkpoints" / "step_1" / "actor"
    build_model("tiny-qwen2", seed=0).save_pretrained(actor)
    return run_dir, actor, markers


def test_eval_of_an_untrusted_run_imports_nothing_from_it(planted_run):
    run_dir, actor, markers = planted_run
    done = baton("eval", str(actor), cwd=run_dir)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "reward_fn 'planted_reward:score'" in err and "--trust-run-dir" in err and "--reward" in err
    assert str(run_dir / "config.yaml") in err
    assert sorted(os.listdir(markers)) == []


def test_eval_and_generate_of_an_untrusted_run_use_the_reward_given(planted_run):
    run_dir, actor, markers = planted_run
    done = baton("eval", str(actor), "--reward", "exact_match", cwd=run_dir)
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout)["reward_fn"] == "exact_match"
    done = baton("generate", str(actor), "--prompt", "1+1=", cwd=run_dir)
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout.splitlines()[0])["prompt"] == "1+1="
    assert sorted(os.listdir(markers)) == []


def test_a_trusted_run_imports_its_reward_but_shadows_nothing(planted_run):
    run_dir, actor, markers = planted_run
    done = baton("eval", str(actor), "--trust-run-dir", cwd=run_dir)
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert (result["reward_fn"], result["mean_reward"]) == ("planted_reward:score", 0.5)
    # Its directories come after the standard library and the installed packages: resource.py, psutil.py lose.
    assert sorted(os.listdir(markers)) == ["planted_reward"]
    os.remove(markers / "planted_reward")


def test_generate_refuses_prompts_that_are_not_utf8_text(planted_run, tmp_path):
    run_dir, actor, markers = planted_run
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"1+1=\n2+\xff=\n")
    for argv, where in ([b"--prompts-file", str(prompts).encode()], f"{prompts}, line 2"), ([b"--prompt", b"2+\xff="],
                                                                                            "--prompt"):
        done = subprocess.run([BATON.encode(), b"generate", str(actor).encode(), *argv], cwd=tmp_path,
                              capture_output=True, timeout=TIME_LIMIT_S)
        err = done.stderr.decode(errors="replace")
        assert done.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"baton: error: {where}: " in err and "is not UTF-8 text" in err


def test_eval_and_generate_refuse_absurd_sampling(planted_run, capsys):
    from baton.cli import main

    run_dir, actor, markers = planted_run
    assert main(["generate", str(actor), "--prompt", "1+1=", "--max-new-tokens", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_new_tokens=1000000000" in err and "max_position_embeddings=256" in err
    for flag, value in (("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"),
                        ("--num-samples", "0"), ("--max-new-tokens", "-5")):
        with pytest.raises(SystemExit) as info:
            main(["eval", str(actor), flag, value])
        assert info.value.code == 2
        assert f"argument {flag}: {value!r} is not a" in capsys.readouterr().err
    assert sorted(os.listdir(markers)) == []


@pytest.fixture
def fresh_paths(monkeypatch):
    """add_config_dir's effects (sys.path, PYTHONPATH, the module's state) undone after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    monkeypatch.setattr(paths, "_IMPORT_DIRS", [])
    monkeypatch.setattr(paths, "_config_dir", None)


def test_config_directories_are_appended_and_world_writable_ones_never_used(tmp_path, monkeypatch, fresh_paths):
    own, shared = tmp_path / "own", tmp_path / "shared"
    own.mkdir()
    shared.mkdir()
    shared.chmod(0o777)
    (own / paths.IMPORT_DIRS_FILE).write_text(f"{shared}\n/tmp\nrelative/dir\n")
    monkeypatch.chdir(shared)
    with pytest.warns(UserWarning, match=f"{shared} is world-writable"):
        paths.add_config_dir(own / "run.yaml")
    assert paths._IMPORT_DIRS == [str(own)] and sys.path[-1] == str(own) and str(shared) not in sys.path
    paths.record_import_dirs(str(tmp_path))
    assert (tmp_path / paths.IMPORT_DIRS_FILE).read_text() == f"{own}\n"
    paths.add_config_dir(shared / "run.yaml", importable=False)  # data only: found beside it, nothing imported
    assert paths._IMPORT_DIRS == [str(own)] and paths._config_dir == str(shared)


# --- bad configs and data ----------------------------------------------------------------------------------------

RLVR = "pipeline_cls: baton.pipelines.rlvr:RLVRPipeline\ntrainer: {backend: local, run_dir: out}\n"
BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{b}' if b else '1'] * 9)}]\n"
               for a, b in zip("abcdefghi", [None, *"abcdefgh"]))

# name -> (file name, contents, what the one line says)
CASES = {
    "pipeline_cls a function": ("c.yaml", "pipeline_cls: baton.cli:main\n", "c.yaml: pipeline_cls 'baton.cli:main' names an object of type function, not a pipeline class"),
    "pipeline_cls an int": ("c.yaml", "pipeline_cls: baton.models.build:MAX_PARAMETERS\n", "names an object of type int, not a pipeline class"),
    "deep yaml": ("c.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n", "c.yaml:1:67: invalid YAML: nested deeper than 64 levels"),
    "deep json": ("c.json", '{"a": ' + "{\"b\": " * 3000 + "1" + "}" * 3001 + "\n", "c.json:1:380: invalid YAML: nested deeper than 64 levels"),
    "alias bomb": ("c.yaml", BOMB, "c.yaml:1:4: invalid YAML: more than 1000000 values once its aliases are expanded"),
    "alias cycle": ("c.yaml", "a: &a [1, *a]\n", "c.yaml:1:4: invalid YAML: an alias refers to the node that holds it"),
    "duplicate key": ("c.yaml", RLVR + "sampling:\n  max_new_tokens: 4\n  temperature: 1.0\n  max_new_tokens: 6\n",
                      "c.yaml:6:3: invalid YAML: duplicate key 'max_new_tokens' (first on line 4)"),
    "not utf-8": ("c.yaml", RLVR.encode() + b"seed: \"\xff\"\n", "c.yaml:3: the byte b'\\xff' at byte offset"),
    "lone surrogate in yaml": ("c.yaml", RLVR + 'data: {prompt_key: "\\ud800"}\n', "c.yaml:3:20: invalid YAML: a lone surrogate"),
    "1e8 layers": ("c.yaml", RLVR + "actor: {strategy: {model: {base: tiny-qwen2, num_hidden_layers: 100000000}}}\n",
                   "c.yaml: actor.strategy.model: num_hidden_layers is 100000000; it must be a whole number from 1 to 1024"),
    "absurd hidden size": ("c.yaml", RLVR + "actor: {strategy: {model: {base: tiny-qwen2, hidden_size: 1.0e7}}}\n",
                           "actor.strategy.model: hidden_size is 10000000.0; it must be a whole number"),
    "too many parameters": ("c.yaml", RLVR + "actor: {strategy: {model: {base: tiny-qwen2, num_hidden_layers: 1024, "
                            "hidden_size: 16384, intermediate_size: 65536}}}\n", "parameters, more than max_parameters 20B"),
    "nan lr": ("c.yaml", RLVR + "actor: {strategy: {optimizer: {lr: .nan}}}\n", "'actor.strategy.optimizer': lr is nan"),
    "infinite lr": ("c.yaml", RLVR + "actor: {strategy: {optimizer: {lr: .inf}}}\n", "'actor.strategy.optimizer': lr is inf"),
    "zero lr": ("c.yaml", RLVR + "actor: {strategy: {optimizer: {lr: 0}}}\n", "'actor.strategy.optimizer': lr is 0.0"),
    "negative lr": ("c.yaml", RLVR + "critic: {strategy: {optimizer: {lr: -1e-5}}}\n", "'critic.strategy.optimizer': lr is -1e-05"),
    "absurd max_new_tokens": ("c.yaml", RLVR + "sampling: {max_new_tokens: 1000000000}\n",
                              "sampling.max_new_tokens=1000000000 makes sequences of 1000000064 tokens, more than "
                              "actor.strategy.model's max_position_embeddings=256"),
    "absurd max_prompt_len": ("c.yaml", RLVR + "data: {max_prompt_len: 1000000000}\n", "data.max_prompt_len=1000000000 + "),
    "data not utf-8": ("c.yaml", RLVR + "data: {task: files, train_path: bad.jsonl}\n", "bad.jsonl, line 2: the byte b'\\xff'"),
    "step past the data": ("c.yaml", RLVR.replace("}", ", num_prompts_per_step: 4}") +
                           "data: {task: files, train_path: two.jsonl}\n",
                           "trainer.num_prompts_per_step=4 is more than the 2 prompts of the training data"),
}


# `baton run` checks what `baton config` does before it starts anything; a few cases show it.
RUN_CASES = ("deep yaml", "alias bomb", "1e8 layers", "nan lr", "data not utf-8")


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[tuple[str, str], tuple[subprocess.CompletedProcess | None, list, list]]:
    """Each case's `baton config` (and `baton run` of RUN_CASES), four at a time, each in a directory of its own: (the process,
    None if it hung past TIME_LIMIT_S, the directory's files before, after)."""
    def refuse(name: str, command: str):
        file_name, text, _ = CASES[name]
        cwd = tmp_path_factory.mktemp("case")
        (cwd / file_name).write_bytes(text.encode() if isinstance(text, str) else text)
        (cwd / "bad.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff", "answer": "1"}\n')
        (cwd / "two.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3"}\n')
        before = sorted(os.listdir(cwd))
        try:
            done = baton(command, file_name, cwd=cwd)
        except subprocess.TimeoutExpired:
            done = None
        return done, before, sorted(os.listdir(cwd))

    keys = [(name, "config") for name in CASES] + [(name, "run") for name in RUN_CASES]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(keys, pool.map(lambda key: refuse(*key), keys)))


@pytest.mark.parametrize("name, command", [(name, "config") for name in CASES] + [(name, "run") for name in RUN_CASES])
def test_a_bad_config_is_one_line_naming_the_problem(refused, name, command):
    done, before, after = refused[name, command]
    assert done is not None, f"baton {command} hung (killed after {TIME_LIMIT_S} s)"
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err
    assert err.startswith("baton: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert CASES[name][2] in err
    assert "resume=latest" not in err
    assert after == before  # nothing written: no error.log, no run directory


def test_yaml_limits_follow_aliases_and_leave_merge_keys_alone():
    nested = "a: &a " + "[" * 40 + "1" + "]" * 40 + "\nb: &b " + "[" * 30 + "*a" + "]" * 30 + "\n"
    with pytest.raises(Exception, match="nested deeper than 64 levels \\(through aliases\\)"):
        parse_yaml(nested)
    assert parse_yaml("base: &base {x: 1, y: 2}\nother:\n  <<: *base\n  x: 3\n")["other"] == {"x": 3, "y": 2}
    shared = parse_yaml("a: &a {q: 1}\nb: [*a, *a]\n")
    assert shared["b"] == [{"q": 1}, {"q": 1}]


def test_a_bad_override_value_is_refused_like_a_file(tmp_path):
    from baton.config import apply_overrides
    from baton.pipelines.config import RLVRConfig

    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        apply_overrides({}, ["actor.env_vars=" + "[" * 100 + "]" * 100], RLVRConfig)
    (tmp_path / "ok.yaml").write_text("seed: 3\n")
    assert load_yaml(tmp_path / "ok.yaml") == {"seed": 3}


def test_a_config_loaded_after_an_untrusted_run_that_recorded_its_directory_finds_its_modules(tmp_path, monkeypatch,
                                                                                           fresh_paths):
    """Opening an untrusted run takes the directories it recorded off sys.path; a config loaded from one of them
    afterwards must make it importable again (it found nothing when the earlier load was remembered, and the
    verl_format example then failed to import its reward after a test had evaluated a run of another example)."""
    from baton.pipelines.evaluate import run_config

    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "myreward_mod.py").write_text("def score(response, ground_truth, **fields):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    paths.add_config_dir(examples / "task.yaml")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1" / "actor").mkdir(parents=True)
    (run / "config.yaml").write_text("pipeline_cls: baton.pipelines.sft:SFTPipeline\n")
    (run / paths.IMPORT_DIRS_FILE).write_text(f"{examples}\n")
    run_config(str(run / "checkpoints" / "step_1" / "actor"))  # untrusted: examples/ leaves sys.path
    assert str(examples) not in sys.path
    paths.add_config_dir(examples / "task.yaml")
    assert str(examples) in sys.path and importlib.util.find_spec("myreward_mod") is not None

"""Distillation: the KL variants against hand-computed values, top-k (with its tail) against the full vocabulary at
k = vocab, the JSD's limits, bad input, the teacher's top-k on its workers, the student's loss through train_step,
and the pipeline (both modes, teacher responses, exact resume) and the demo for 2 steps on the local backend."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from baton.algorithms.distill import distillation_loss, token_distill_loss, with_tail
from baton.cli import resolve
from baton.config import ConfigError
from baton.datasets import arithmetic_splits, collate_sft
from baton.models import load_tokenizer
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.distill import DistillConfig, DistillPipeline, DistillSettings
from baton.rl.losses import TEACHER_TOP_K_IDS, TEACHER_TOP_K_LOG_PROBS, DistillLoss
from baton.strategy import StrategyConfig
from baton.tracking import read_metrics, run_metrics
from test_pipeline_paths import weights

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

# One token over a 4-token vocabulary. The teacher's top-2 are tokens 0 and 1; the tail holds tokens 2 and 3:
# teacher (0.4, 0.3 | 0.3), student (0.1, 0.2 | 0.7) on the outcomes (token 0, token 1 | rest).
TEACHER = torch.tensor([0.4, 0.3, 0.2, 0.1])
STUDENT = torch.tensor([0.1, 0.2, 0.3, 0.4])
FORWARD_TOP2 = 0.4 * math.log(0.4 / 0.1) + 0.3 * math.log(0.3 / 0.2) + 0.3 * math.log(0.3 / 0.7)
REVERSE_TOP2 = 0.1 * math.log(0.1 / 0.4) + 0.2 * math.log(0.2 / 0.3) + 0.7 * math.log(0.7 / 0.3)
# β = 0.5: the mixture M = (0.25, 0.25 | 0.5)
JSD_TOP2 = (0.5 * (0.4 * math.log(0.4 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.3 * math.log(0.3 / 0.5))
            + 0.5 * (0.1 * math.log(0.1 / 0.25) + 0.2 * math.log(0.2 / 0.25) + 0.7 * math.log(0.7 / 0.5)))
FORWARD_FULL = sum(p * math.log(p / q) for p, q in zip(TEACHER.tolist(), STUDENT.tolist()))


def one_token(k: int):
    """(student log-softmax [1, 1, 4], teacher top-k log-probs and ids [1, 1, k], mask [1, 1])."""
    top = TEACHER.log().topk(k)
    return STUDENT.log().view(1, 1, 4), top.values.view(1, 1, k), top.indices.view(1, 1, k), torch.ones(1, 1)


@pytest.mark.parametrize("loss_type, beta, expected", [
    ("forward_kl", 0.5, FORWARD_TOP2), ("reverse_kl", 0.5, REVERSE_TOP2), ("jsd", 0.5, JSD_TOP2),
    ("jsd", 0.0, FORWARD_TOP2), ("jsd", 1.0, REVERSE_TOP2)])
def test_each_divergence_on_the_top_k_and_its_tail_matches_the_hand_computed_value(loss_type, beta, expected):
    student, teacher, ids, mask = one_token(2)
    assert ids.tolist() == [[[0, 1]]]
    loss = distillation_loss(loss_type, student, teacher, ids, mask, beta=beta)
    assert float(loss) == pytest.approx(expected, abs=1e-6)


def test_the_tail_is_one_outcome_so_top_k_is_a_lower_bound_and_k_equal_to_vocab_is_the_full_kl():
    student, teacher, ids, mask = one_token(4)
    assert float(distillation_loss("forward_kl", student, teacher, ids, mask)) == pytest.approx(FORWARD_FULL, abs=1e-6)
    assert FORWARD_TOP2 < FORWARD_FULL  # merging tokens 2 and 3 lowers the divergence
    assert with_tail(teacher)[..., -1].exp().item() < 1e-30  # the empty tail weighs nothing
    assert with_tail(one_token(2)[1])[..., -1].exp().item() == pytest.approx(0.3, abs=1e-6)


def test_top_k_at_k_equal_to_vocab_equals_the_full_vocabulary_loss_over_a_masked_batch():
    generator = torch.Generator().manual_seed(0)
    vocab = 11
    student = torch.log_softmax(3 * torch.randn(2, 5, vocab, generator=generator), -1)
    teacher = torch.log_softmax(3 * torch.randn(2, 5, vocab, generator=generator), -1)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    top = teacher.topk(vocab, -1)
    full = {"forward_kl": (teacher.exp() * (teacher - student)).sum(-1),
            "reverse_kl": (student.exp() * (student - teacher)).sum(-1)}
    mixture = torch.log(0.3 * teacher.exp() + 0.7 * student.exp())
    full["jsd"] = 0.3 * (teacher.exp() * (teacher - mixture)).sum(-1) + 0.7 * (student.exp() * (student - mixture)).sum(-1)
    for loss_type, per_token in full.items():
        expected = float((per_token * mask).sum() / mask.sum())  # token-mean over the 8 response tokens
        got = distillation_loss(loss_type, student, top.values, top.indices, mask, beta=0.3)
        assert float(got) == pytest.approx(expected, rel=1e-6, abs=1e-5), loss_type
        seq = distillation_loss(loss_type, student, top.values, top.indices, mask, "seq-mean-token-sum", beta=0.3)
        assert float(seq) == pytest.approx(float((per_token * mask).sum(-1).mean()), rel=1e-6, abs=1e-5), loss_type
        assert float(F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)[0, 0]) == pytest.approx(
            float(full["forward_kl"][0, 0]), abs=1e-5)  # the reference formula is torch's KL
    for k in (1, 3, 6):  # fewer outcomes: never above the full divergence
        top = teacher.topk(k, -1)
        for loss_type, per_token in full.items():
            part = token_distill_loss(loss_type, student.gather(-1, top.indices), top.values, beta=0.3)
            assert bool((part <= per_token + 1e-5).all()), (loss_type, k)


def test_the_generalised_jsd_tends_to_the_forward_kl_near_beta_0_and_the_reverse_kl_near_beta_1():
    student, teacher, ids, _ = one_token(3)
    gathered = student.gather(-1, ids)
    forward = float(token_distill_loss("forward_kl", gathered, teacher))
    reverse = float(token_distill_loss("reverse_kl", gathered, teacher))
    small = 1e-3
    assert float(token_distill_loss("jsd", gathered, teacher, beta=small)) / small == pytest.approx(forward, rel=2e-2)
    assert float(token_distill_loss("jsd", gathered, teacher, beta=1 - small)) / small == pytest.approx(reverse, rel=2e-2)
    assert 0 < float(token_distill_loss("jsd", gathered, teacher, beta=0.5)) < math.log(2)  # the JSD's bound


def test_the_gradient_reaches_the_students_log_probs_and_pulls_towards_the_teacher():
    student, teacher, ids, mask = one_token(2)
    logits = student.clone().requires_grad_(True)
    distillation_loss("forward_kl", torch.log_softmax(logits, -1), teacher, ids, mask).backward()
    # Token 0 (teacher 0.4, student 0.1) is pulled up; tokens 2 and 3 (the tail: teacher 0.3, student 0.7) down.
    assert logits.grad[0, 0, 0] < 0 and logits.grad[0, 0, 2] > 0 and logits.grad[0, 0, 3] > 0


@pytest.mark.parametrize("call, message", [
    (lambda s, t, i, m: distillation_loss("forward_kl", s, torch.zeros(1, 1, 5), torch.zeros(1, 1, 5, dtype=torch.long), m),
     "top-k k=5 is larger than the vocabulary \\(4 tokens\\); use k <= 4"),
    (lambda s, t, i, m: distillation_loss("forward_kl", s, t, i[..., :1], m), "differ in shape"),
    (lambda s, t, i, m: distillation_loss("kl", s, t, i, m), "unknown distillation loss 'kl'; valid: \\['forward_kl', "
                                                              "'jsd', 'reverse_kl'\\]"),
    (lambda s, t, i, m: distillation_loss("jsd", s, t, i, m, beta=1.5), "jsd beta=1.5 is outside \\[0, 1\\]"),
    (lambda s, t, i, m: distillation_loss("forward_kl", s, t, i + 3, m), "outside the student's vocabulary of 4"),
    (lambda s, t, i, m: distillation_loss("forward_kl", s[:, :0], t, i, m), "cover different \\[rows, response_len\\]"),
])
def test_bad_input_is_refused_with_the_problem_and_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call(*one_token(2))


def sft_batch(num_rows: int = 4):
    tokenizer = load_tokenizer()
    train, _ = arithmetic_splits(9, "+", 8, seed=0)
    return collate_sft(train, list(range(num_rows)), tokenizer, 16)


def test_the_teachers_top_k_is_k_values_and_ids_per_token_and_the_students_loss_at_k_vocab_is_the_full_kl():
    from baton.strategy.hf import HFStrategy

    batch = sft_batch()
    teacher = HFStrategy(StrategyConfig(model="tiny-qwen2", seed=1))
    student = HFStrategy(StrategyConfig(model="tiny-qwen2", seed=0, micro_batch_size_per_worker=2))
    vocab = teacher.hf_model.config.vocab_size
    rows, response_len = batch.batch["responses"].shape
    top = teacher.top_k_log_probs(batch, 5)
    assert sorted(top.batch.keys()) == ["top_k_ids", "top_k_log_probs"]  # nothing of the vocabulary's size
    assert top.batch["top_k_log_probs"].shape == top.batch["top_k_ids"].shape == (rows, response_len, 5)

    def full_log_probs(strategy):  # [rows, response_len, vocab] from a plain forward pass
        with torch.no_grad():
            logits = strategy.hf_model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                                       position_ids=batch.batch["position_ids"]).logits
        return torch.log_softmax(logits[:, -response_len - 1:-1].float(), -1)

    reference = full_log_probs(teacher).topk(5, -1)
    real = batch.batch["attention_mask"][:, -response_len:].bool()  # padding positions skip the LM head: zeros
    assert torch.equal(top.batch["top_k_ids"][real], reference.indices[real])
    assert torch.allclose(top.batch["top_k_log_probs"][real], reference.values[real], atol=1e-5)
    assert not real.all() and top.batch["top_k_log_probs"][~real].abs().sum() == 0
    with pytest.raises(ValueError, match=f"top-k k={vocab + 1} must be in \\[1, {vocab}\\]"):
        teacher.top_k_log_probs(batch, vocab + 1)

    everything = teacher.top_k_log_probs(batch, vocab)
    batch.batch[TEACHER_TOP_K_LOG_PROBS] = everything.batch["top_k_log_probs"]
    batch.batch[TEACHER_TOP_K_IDS] = everything.batch["top_k_ids"]
    t, s, mask = full_log_probs(teacher), full_log_probs(student), batch.batch["response_mask"]
    expected = float(((t.exp() * (t - s)).sum(-1) * mask).sum() / mask.sum())
    result = student.train_step(batch, DistillLoss("forward_kl"), "token")  # two micro-batches of 2 rows
    assert result["distill/loss"] == pytest.approx(expected, abs=1e-5)
    assert result["loss"] == pytest.approx(expected, abs=1e-5)
    assert result["distill/forward_kl"] == pytest.approx(expected, abs=1e-5)
    assert result["distill/teacher_top_k_mass"] == pytest.approx(1.0, abs=1e-5)
    agreement = float(((s.argmax(-1) == t.argmax(-1)).float() * mask).sum() / mask.sum())  # top-1s, by hand
    assert 0 < result["grad_norm"] and result["distill/top1_agreement"] == pytest.approx(agreement, abs=1e-6)

    # Hinton's mix: (1 - w) * the KL + w * the responses' NLL, each by hand. The update above moved the student.
    s = full_log_probs(student)
    kl = float(((t.exp() * (t - s)).sum(-1) * mask).sum() / mask.sum())
    nll = -s.gather(-1, batch.batch["responses"][..., None])[..., 0]  # [rows, response_len]
    nll = float((nll * mask).sum() / mask.sum())
    mixed = student.train_step(batch, DistillLoss("forward_kl", sft_weight=0.25), "token")
    assert mixed["distill/sft_nll"] == pytest.approx(nll, abs=1e-5)
    assert mixed["distill/loss"] == pytest.approx(0.75 * kl + 0.25 * nll, abs=1e-5)


def tiny_distill(tmp_path, mode="off_policy", responses=None, **trainer) -> DistillConfig:
    settings = dict(backend="local", run_dir=str(tmp_path / "run"), num_steps=2, num_prompts_per_step=4,
                    val_every_steps=2, save_every_steps=2, progress_bar=False)
    return DistillConfig(actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2")),
                         teacher=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", seed=1)),
                         algorithm=DistillSettings(loss_type="jsd", top_k=4, mode=mode, responses=responses),
                         data=DataConfig(max_operand=9, num_val_examples=8),
                         sampling=SamplingConfig(temperature=1.0, max_new_tokens=3, num_samples_per_prompt=2),
                         val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                         trainer=TrainerConfig(**{**settings, **trainer}))


@pytest.mark.parametrize("mode, responses", [("off_policy", None), ("off_policy", "teacher"), ("on_policy", None)])
def test_the_pipeline_runs_two_steps_in_each_mode_and_writes_the_three_accuracies(tmp_path, mode, responses):
    pipeline = DistillPipeline(tiny_distill(tmp_path, mode, responses))
    try:
        prompts = sft_batch(3)
        scores = pipeline.teacher.compute_top_k_log_probs(prompts, 4)  # on the teacher's worker
        assert {k: tuple(v.shape) for k, v in scores.batch.items()} == {
            "top_k_log_probs": (3, prompts.batch["responses"].shape[1], 4),
            "top_k_ids": (3, prompts.batch["responses"].shape[1], 4)}
        summary = pipeline.run()
    finally:
        pipeline.shutdown()
    run_dir = tmp_path / "run"
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("distill/loss", "distill/forward_kl", "distill/reverse_kl", "distill/teacher_top_k_mass",
                "distill/top1_agreement", "actor/grad_norm", "timing_s/teacher", "response_length/mean"):
        assert key in records[1] and math.isfinite(records[1][key]), key
    assert records[1]["distill/loss"] > 0 and 0 < records[1]["distill/teacher_top_k_mass"] <= 1
    assert ("timing_s/generate" in records[1]) == (responses == "teacher" or mode == "on_policy")
    if responses is None and mode == "off_policy":  # the dataset's answers: a digit or two and the eos
        assert records[1]["response_length/mean"] <= 3
    written = json.load(open(run_dir / "summary.json"))
    assert written["start_val_accuracy"] == records[0]["val/accuracy"]
    assert written["teacher_val_accuracy"] == records[0]["val/teacher_accuracy"] is not None
    assert written["final_val_accuracy"] == records[-1]["val/accuracy"] == summary["final_val_accuracy"]
    assert written["response_source"] == {"on_policy": "student"}.get(mode, responses or "dataset")
    assert os.path.isdir(run_dir / "checkpoints" / "step_2" / "actor")
    assert not os.path.exists(run_dir / "checkpoints" / "step_2" / "teacher")  # frozen: never saved


@pytest.mark.parametrize("mode, responses", [("on_policy", None), ("off_policy", "teacher")])
def test_a_resumed_run_continues_exactly_as_the_uninterrupted_one(tmp_path, mode, responses):
    def distill(name: str, **trainer) -> str:
        run_pipeline(DistillPipeline, tiny_distill(tmp_path / name, mode, responses, val_every_steps=3,
                                                   save_every_steps=1, **trainer))
        return str(tmp_path / name / "run")

    straight = distill("a", num_steps=3)
    distill("b", num_steps=1)
    resumed = distill("b", num_steps=3, resume="latest")
    expected, got = run_metrics(straight), run_metrics(resumed)
    assert sorted(got) == sorted(expected) == [0, 1, 2, 3]
    assert "distill/loss" in expected[3] and "val/accuracy" in expected[3]
    # Every metric, bit for bit (the samples, and so the losses, are the same); at step 1 the stopped run also
    # validated (its last step), the straight one did not.
    assert {k: got[1][k] for k in expected[1]} == expected[1] and set(got[1]) - set(expected[1]) == {
        k for k in got[1] if k.startswith(("val/", "val-core/"))}
    assert [got[step] for step in (0, 2, 3)] == [expected[step] for step in (0, 2, 3)]
    for step in (2, 3):  # the weights the steps after the resume saved
        before, after = weights(straight, step, "actor"), weights(resumed, step, "actor")
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), step


@pytest.mark.parametrize("change, message", [
    (dict(teacher=None), "distillation needs a `teacher:` section"),
    (dict(loss_type="kl"), "algorithm.loss_type 'kl' is not one of \\['forward_kl', 'jsd', 'reverse_kl'\\]"),
    (dict(beta=1.5), "algorithm.beta=1.5 is outside \\[0, 1\\]"),
    (dict(top_k=10_000), "algorithm.top_k=10000 must be in \\[1, "),
    (dict(top_k=0), "algorithm.top_k=0 must be in \\[1, "),
    (dict(mode="online"), "algorithm.mode 'online' is not one of \\['off_policy', 'on_policy'\\]"),
    (dict(mode="on_policy", responses="teacher"), "with mode on_policy: on-policy distillation trains on the student's"),
    (dict(responses="mine"), "algorithm.responses 'mine' is not one of"),
    (dict(temperature=0.0), "algorithm.temperature=0.0 must be > 0"),
    (dict(sft_weight=1.5), "algorithm.sft_weight=1.5 is outside \\[0, 1\\]"),
    (dict(sft_weight=0.5, mode="on_policy"), "sft_weight=0.5 with student responses: the hard-label term trains on right"),
    (dict(teacher_model={"base": "tiny-qwen2", "vocab_size": 200}), "teacher and student must share a tokenizer"),
    (dict(teacher_kind="value"), "a teacher is a causal LM"),
])
def test_a_config_that_cannot_run_fails_before_anything_starts(tmp_path, change, message):
    config = tiny_distill(tmp_path)
    algo = config.algorithm
    for name in ("loss_type", "beta", "top_k", "mode", "responses", "temperature", "sft_weight"):
        if name in change:
            setattr(algo, name, change[name])
    if "teacher" in change:
        config.teacher = None
    if "teacher_model" in change:
        config.teacher.strategy.model = change["teacher_model"]
    if "teacher_kind" in change:
        config.teacher.strategy.kind = change["teacher_kind"]
    with pytest.raises(ConfigError, match=message):
        config.check()


def test_beta_with_a_kl_loss_is_ignored_with_a_warning(tmp_path):
    config = tiny_distill(tmp_path)
    config.algorithm.loss_type, config.algorithm.beta = "reverse_kl", 0.9
    with pytest.warns(UserWarning, match="algorithm.beta=0.9 is ignored: loss_type 'reverse_kl' has no beta"):
        config.check()


def test_the_example_takes_run_dir_and_seed_and_compares_like_with_like():
    _, config = resolve(os.path.join(EXAMPLES, "distill.yaml"), ["run_dir=out/x", "seed=2"])
    assert [config.stage(s).trainer.run_dir for s in config.stages] == ["out/x/teacher", "out/x/distill", "out/x/sft_alone"]
    assert {config.teacher.trainer.seed, config.distill.actor.strategy.seed, config.sft_alone.actor.strategy.seed,
            config.distill.teacher.strategy.seed} == {2}
    assert config.teacher.actor.strategy.model == {"base": "small-qwen2", "num_hidden_layers": 4}
    # The teacher learns exact answers; the students have the weak labeler's, on the same problems and held-out split.
    teacher_data, student_data = config.stage("teacher").data, config.stage("sft_alone").data
    assert teacher_data.teacher_error == 0 and student_data.teacher_error == 0.3
    assert config.stage("distill").data == student_data
    assert dataclasses.replace(teacher_data, teacher_error=0.3) == student_data
    distill, alone = config.stage("distill"), config.stage("sft_alone")
    assert distill.actor.strategy.model == alone.actor.strategy.model == "tiny-qwen2"  # the same start
    assert distill.actor.strategy.optimizer == alone.actor.strategy.optimizer
    assert distill.actor.strategy.scheduler == alone.actor.strategy.scheduler
    for key in ("num_steps", "num_prompts_per_step", "val_every_steps"):
        assert getattr(distill.trainer, key) == getattr(alone.trainer, key), key
    with pytest.raises(ConfigError, match="set run_dir instead"):
        resolve(os.path.join(EXAMPLES, "distill.yaml"), ["distill.trainer.run_dir=elsewhere"])
    with pytest.warns(UserWarning, match="teacher.data and data differ in max_operand"):
        resolve(os.path.join(EXAMPLES, "distill.yaml"), ["data.max_operand=9"])


def test_the_demo_trains_a_teacher_distils_it_and_runs_sft_alone_and_a_resume_reruns_nothing(tmp_path):
    from baton.recipes.distill import DistillDemoPipeline

    example = os.path.join(EXAMPLES, "distill.yaml")
    settings = [f"run_dir={tmp_path / 'demo'}", "data.max_operand=9", "data.num_val_examples=8",
                "teacher.data.max_operand=9", "teacher.data.num_val_examples=8", "teacher.actor.strategy.model=tiny-qwen2"]
    for stage in ("teacher", "distill", "sft_alone"):
        settings += [f"{stage}.trainer.backend=local", f"{stage}.trainer.progress_bar=false",
                     f"{stage}.trainer.num_steps=2", f"{stage}.trainer.num_prompts_per_step=4",
                     f"{stage}.trainer.save_every_steps=2", f"{stage}.trainer.val_every_steps=1",
                     f"{stage}.val_sampling.max_new_tokens=3"]
    summary = DistillDemoPipeline(resolve(example, settings)[1]).run()
    written = json.load(open(tmp_path / "demo" / "summary.json"))
    assert written["teacher_val_accuracy"] == summary["teacher"]["final_val_accuracy"]  # the same checkpoint, scored
    assert written["target_val_accuracy"] == pytest.approx(0.8 * written["teacher_val_accuracy"])
    assert written["final_val_accuracy"] == summary["distill"]["final_val_accuracy"] is not None
    assert written["sft_alone_final_val_accuracy"] == summary["sft_alone"]["final_val_accuracy"] is not None
    for name in ("distill", "sft_alone"):
        records = read_metrics(str(tmp_path / "demo" / name / "metrics.jsonl"))
        reached = [r["step"] for r in records if r["val/accuracy"] >= written["target_val_accuracy"]]
        key = "steps_to_target" if name == "distill" else "sft_alone_steps_to_target"
        assert written[key] == (reached[0] if reached else None)
    teacher_model = resolve(os.path.join(tmp_path, "demo", "distill", "config.yaml"), [])[1].teacher.strategy.model
    assert teacher_model.endswith(os.path.join("teacher", "checkpoints", "step_2", "actor"))
    before = {name: (tmp_path / "demo" / name / "metrics.jsonl").read_text() for name in ("teacher", "distill", "sft_alone")}
    DistillDemoPipeline(resolve(example, settings + ["resume=latest"])[1]).run()
    assert {name: (tmp_path / "demo" / name / "metrics.jsonl").read_text() for name in before} == before

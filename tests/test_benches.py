"""Every bench in bench/ runs in its `--quick` mode and writes the JSON keys it promises: a bench no test runs rots
unseen. Only keys and counts are checked, never a time or a speed (a quick run's figures are not the bench's).

Each bench pays its own imports, Ray start and worker builds (minutes in all), so these are marked `benches`:
the README's test command leaves them out (pyproject.toml) and `.ci/run` runs them as a pass of their own."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.benches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Only catches a hang: a quick bench took up to ~7 minutes on a 2-core machine under a load average of 10-28.
TIMEOUT_S = 600
HAS_TRL = importlib.util.find_spec("trl") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
TESTED = {"controller", "dag", "demo_seeds", "e2e", "engines", "gpu_check", "rollout", "sandbox", "scale", "strategy",
          "sync", "trace"}  # bench/common.py is shared code


def run_bench(name: str, tmp_path, *args: str) -> dict:
    """`bench/<name>.py --quick --json PATH *args` in a fresh process from the repository root; its figures.

    Each bench starts (and shuts down) a local Ray instance of its own with explicit num_cpus, beside the test session's
    cluster: RAY_ADDRESS is dropped so that none of them joins that cluster."""
    json_path = tmp_path / f"{name}.json"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = [sys.executable, os.path.join("bench", f"{name}.py"), "--quick", "--json", str(json_path), *args]
    # A session of its own, so that a hung bench is stopped with everything it started.
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"bench/{name}.py --quick did not finish within {TIMEOUT_S} s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    assert process.returncode == 0, (f"bench/{name}.py --quick exited {process.returncode}:\n{stdout[-2000:]}\n"
                                     f"{stderr[-4000:]}")
    with open(json_path) as f:
        figures = json.load(f)
    assert figures["quick"] is True
    return figures


def has_keys(mapping: dict, *keys: str) -> None:
    missing = [key for key in keys if key not in mapping]
    assert not missing, f"missing {missing}; present: {sorted(mapping)}"


def test_every_bench_script_is_run_here():
    scripts = {os.path.basename(path).removesuffix(".py") for path in glob.glob(os.path.join(REPO, "bench", "*.py"))}
    assert scripts - {"common"} == TESTED


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_controller_bench(tmp_path):
    figures = run_bench("controller", tmp_path)
    has_keys(figures, "noop_ratio_vs_ray", "dp_echo_ratio_vs_ray", "driver_rss_growth", "noop", "dp_echo",
             "dataproto_ops", "driver_rss", "targets", "passed")
    for call in ("noop", "dp_echo"):
        has_keys(figures[call], "baton_ms", "ray_ms", "ratio", "calls")
    has_keys(figures["dataproto_ops"], "chunk_concat", "pickle5_round_trip", "ray_put_get")
    has_keys(figures["driver_rss"], "peak_rss_1x_mib", "peak_rss_8x_mib", "growth", "get_contrast")
    assert set(figures["passed"]) == set(figures["targets"]) == {"noop_ratio_vs_ray", "dp_echo_ratio_vs_ray",
                                                                 "driver_rss_growth"}
    # The by-reference runs must not be blind: fetching the 8x batch into the driver shows up in its RSS.
    rss = figures["driver_rss"]
    assert rss["get_contrast"]["growth_mib"] > rss["max_growth_in_run_8x_mib"]


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_strategy_bench(tmp_path):
    figures = run_bench("strategy", tmp_path)
    has_keys(figures, "generate_ratio_vs_plain", "train_ratio_vs_plain", "generate", "train", "threads", "passed")
    for part in ("generate", "train"):
        has_keys(figures[part], "baton_s", "plain_s", "baton_in_worker_s", "ratio", "baton_tokens_per_s")
    assert len(figures["generate"]["baton_times_s"]) == figures["repetitions"]["generate_calls"]
    first = figures["train"]["first_step"]  # same weights, same batch: the bench refuses to time different work
    assert first["baton"]["loss"] == pytest.approx(first["plain"]["loss"], rel=1e-4)
    assert set(figures["passed"]) == {"generate_ratio_vs_plain", "train_ratio_vs_plain"}


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_scale_bench(tmp_path):
    figures = run_bench("scale", tmp_path)
    has_keys(figures, "packed_vs_padded_tokens_per_s", "memory_ratio_vs_naive", "lora_memory_ratio_vs_full",
             "mfu_vs_matmul", "bytes_per_token_per_layer", "matmul_flops_per_s", "sides", "passed")
    sides = figures["sides"]
    assert set(sides) == {"padded", "packed", "naive", "baton", "lora", "tokens_128", "tokens_256", "tokens_512"}
    for name, side in sides.items():
        has_keys(side, "tokens_per_s", "peak_rss_mib", "step_extra_mib", "model_flops", "trainable_parameters")
    assert len({side["tokens"] for name, side in sides.items() if not name.startswith("tokens_")}) == 1  # one batch
    assert sides["lora"]["trainable_parameters"] < sides["baton"]["trainable_parameters"] / 10
    assert set(figures["passed"]) == {"packed_vs_padded_tokens_per_s", "memory_ratio_vs_naive",
                                      "lora_memory_ratio_vs_full"}


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_scale_bench_reports_a_side_past_its_memory_cap_and_goes_on(tmp_path):
    figures = run_bench("scale", tmp_path, "--mem-cap-gib", "0.05")
    assert all(side.get("out_of_memory") for side in figures["sides"].values())
    assert figures["packed_vs_padded_tokens_per_s"] is None and figures["passed"]["packed_vs_padded_tokens_per_s"] is False


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_trace_bench(tmp_path):
    figures = run_bench("trace", tmp_path)
    has_keys(figures, "tracer_share", "events_per_step", "step_s_off", "step_s_on", "passed")
    assert 0 < figures["tracer_share"] < 1 and figures["events_per_step"] > 0


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_sync_bench(tmp_path):
    figures = run_bench("sync", tmp_path)
    has_keys(figures, "sync_gb_per_s", "sync_vs_memcpy", "max_source_rss_vs_model_bytes", "delta_bytes_ratio",
             "delta_bytes_ratio_lora", "max_source_vs_shard_plus_bucket", "memcpy_gb_per_s", "layouts", "passed",
             "object_store_sync_gb_per_s", "collective_sync_gb_per_s", "unchecked_sync_vs_memcpy")
    assert {(entry["sources"], entry["engines"]) for entry in figures["layouts"]} >= {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert figures["fingerprint_catches_skipped_bucket"] is True  # whatever the machine: a check, not a speed
    assert figures["delta_bytes_ratio"] == 1.0  # a full fine-tuning update changes every weight


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_engines_bench_runs_the_installed_engines(tmp_path):
    figures = run_bench("engines", tmp_path)
    has_keys(figures, "hf_batch_tokens_per_s", "hf_engine_ratio_vs_batch", "hf_tokens_per_s", "weight_update_s",
             "models", "passed")
    engines = {"hf_engine", "vllm_engine"} if HAS_VLLM else {"hf_engine"}
    assert set(figures["models"]) == {"small-qwen2"}
    assert set(figures["models"]["small-qwen2"]["engines"]) == set(figures["weight_update_s"]) == engines
    assert ("vllm_tokens_per_s" in figures) == HAS_VLLM
    assert set(figures["passed"]) == {"hf_engine_ratio_vs_batch"}


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_e2e_bench_runs_baton_and_trl_where_installed(tmp_path):
    figures = run_bench("e2e", tmp_path, "--run-dir", str(tmp_path / "run"))
    has_keys(figures, "baton", "baton_step_s", "baton_tokens_per_s", "baton_reward", "baton_val_accuracy",
             "sft_val_accuracy", "targets", "passed")
    assert len(figures["baton"]["step_times_s"]) == figures["num_steps"]
    if HAS_TRL:
        has_keys(figures, "trl", "step_time_ratio_vs_trl", "trl_val_accuracy", "goal_met")
        assert set(figures["passed"]) == {"no_slower_at_equal_reward"}
    else:
        assert "trl" not in figures and figures["passed"] == {}
        assert "step_time_ratio_vs_trl" in figures["missing"]


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_demo_seeds_bench(tmp_path):
    figures = run_bench("demo_seeds", tmp_path, "--run-dir", str(tmp_path / "run"))
    has_keys(figures, "num_seeds", "min_lift_points", "median_lift_points", "max_lift_points", "max_wall_s",
             "median_sft_accuracy", "median_final_accuracy", "seeds", "passed")
    [seed] = figures["seeds"]
    has_keys(seed, "sft_accuracy", "final_accuracy", "lift_points", "wall_s", "val_curves")
    assert set(seed["val_curves"]) == {"sft", "rlvr"} and all(seed["val_curves"].values())
    assert set(figures["passed"]) == {"min_lift_points", "median_lift_points", "max_wall_s", "num_seeds"}


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_rollout_bench_runs_every_mode(tmp_path):
    figures = run_bench("rollout", tmp_path, "--run-dir", str(tmp_path / "run"))
    has_keys(figures, "one_step_off_speedup", "async_speedup", "sync_accuracy", "one_step_off_accuracy",
             "async_accuracy", "overlap_efficiency", "ideal_overlap_efficiency", "sync_gen_share", "core_contention",
             "modes", "runs", "passed", "deterministic_one_step_off_speedup", "deterministic_async_speedup")
    assert set(figures["modes"]) == {"sync", "one_step_off", "async", "one_step_off_deterministic",
                                     "async_deterministic"}
    for mode in figures["modes"].values():
        has_keys(mode, "step_s", "gen_s", "train_s", "cpu_s_per_step", "speedup", "accuracy", "step_over_bound")
    assert [run["seed"] for run in figures["runs"]] == [0] * 5
    assert all(len(run["step_times_s"]) == figures["num_steps"] for run in figures["runs"])


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_rollout_bench_runs_long_traces_under_each_stale_policy(tmp_path):
    figures = run_bench("rollout", tmp_path, "--run-dir", str(tmp_path / "run"), "--long-traces")
    has_keys(figures, "modes", "runs", "passed", "min_tokens", "max_staleness")
    assert set(figures["modes"]) == {"sync", "async", "async_withhold", "async_pace"}
    for mode in figures["modes"].values():
        has_keys(mode, "step_s", "speedup", "stale_groups_per_step", "withheld_tokens", "restarted_samples",
                 "response_length", "length_over_sync", "staleness_max")
        assert mode["staleness_max"] <= figures["max_staleness"]
    # Budgets of 1 to 10 times min_tokens, eos ignored: the responses are longer than the shortest budget.
    assert figures["modes"]["sync"]["response_length"] > figures["min_tokens"]
    assert set(figures["passed"]) == {"bound_kept", "withhold_and_pace_send_none_back"}


@pytest.mark.ray
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_dag_bench(tmp_path):
    figures = run_bench("dag", tmp_path, "--run-dir", str(tmp_path / "run"))
    has_keys(figures, "single_controller_ratio", "parallel_branch_ratio", "branches_s", "step_s", "driver_rss_bytes",
             "multi_controller_built", "passed")
    executors = ["single_controller", "multi_controller"] if figures["multi_controller_built"] else ["single_controller"]
    assert set(figures["step_s"]) == {"loop", *executors}
    # --quick measures the driver RSS of the target's executor only (fresh processes at 1x and 8x).
    assert set(figures["driver_rss_bytes"]) == {executors[-1]}
    assert set(figures["driver_rss_bytes"][executors[-1]]) == {"1x", "8x"}
    has_keys(figures["branches_s"], "critic_train", "actor_train", "both", "ratio")
    if figures["multi_controller_built"]:
        has_keys(figures, "multi_controller_ratio", "driver_rss_growth")
        assert set(figures["passed"]) == {"single_controller_ratio", "parallel_branch_ratio", "multi_controller_ratio",
                                          "driver_rss_growth"}
    else:
        assert set(figures["missing"]) == {"multi_controller_ratio", "driver_rss_growth"}


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_sandbox_bench(tmp_path):
    figures = run_bench("sandbox", tmp_path)
    has_keys(figures, "hardened", "baseline", "throughput_ratio", "cpu_ms_added_per_case", "hardened_layers", "passed")
    for side in ("hardened", "baseline"):
        has_keys(figures[side], "cases_per_s", "cpu_ms_per_case", "all_passed")
        assert figures[side]["all_passed"]
    assert set(figures["passed"]) == {"hardened_cases_pass"}


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_gpu_check_dry_run_runs_every_part_without_ray(tmp_path):
    """Without a GPU, --quick is the dry run: every part on the CPU with tiny models. One side is made to run out of
    memory: it is reported and the sides after it still run."""
    figures = run_bench("gpu_check", tmp_path, "--simulate-oom", "1.5b/padded")
    has_keys(figures, "dry_run", "device", "matmul_bf16_flops_per_s", "peak_flops", "peak_source", "batch", "train",
             "generation", "weight_sync", "offload_reload", "ray_imported", "passed")
    assert figures["dry_run"] is True and figures["peak_source"] == "measured bf16 matmul (cpu)"
    assert figures["ray_imported"] is False  # the GPU machines have no Ray: nothing on this path may import it
    assert '"skipped"' not in json.dumps(figures)  # no part left out for the time budget
    sides = {(model, name): side for model, train in figures["train"].items() for name, side in train["sides"].items()}
    assert set(sides) == {(model, name) for model in ("0.5b", "1.5b")
                          for name in ("padded", "packed", "packed_ckpt", "packed_ckpt_lora")}
    assert "simulated" in sides.pop(("1.5b", "padded"))["out_of_memory"]
    for side in sides.values():
        has_keys(side, "tokens", "tokens_per_s", "mfu", "model_flops", "peak_memory_bytes", "trainable_parameters")
        assert side["tokens"] == figures["batch"]["tokens"]
    for model in ("0.5b", "1.5b"):
        assert sides[(model, "packed_ckpt_lora")]["trainable_parameters"] < sides[(model, "packed")][
            "trainable_parameters"] / 4
    generation = {key: value for key, value in figures["generation"].items() if key != "part_s"}
    assert set(generation) == {"64", "256"}
    for level in generation.values():  # no stop token: every request runs to its new-token limit
        assert level["generated_tokens"] == level["requests"] * level["new_tokens_per_request"]
    sync = figures["weight_sync"]
    assert sync["engine_holds_trained_weights"] is True and sync["bytes"] > 0
    has_keys(figures["offload_reload"], "state_bytes", "allocated_before", "allocated_after_offload",
             "allocated_after_reload", "offload_s", "reload_s")


@pytest.mark.timeout(180)
def test_gpu_check_without_a_gpu_prints_the_skip_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, os.path.join("bench", "gpu_check.py")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    assert figures["skipped"] == "no CUDA device"
    assert figures["device"]["cuda_available"] is False and "torch" in figures["device"]

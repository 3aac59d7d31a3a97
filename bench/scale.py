"""Scale benchmark: one GRPO update of a real model shape on a batch of reasoning-trace lengths, on one worker.

The model has Qwen2.5-0.5B's shape (hidden 896, 14/2 heads, intermediate 4864, vocabulary 151,936, tied) with random
weights, at `--layers` of its 24 layers (the per-layer figures hold at any depth; all 24 need hours on a 2-core CPU).
The batch: `--rows` responses with log-normal lengths (mean about `--mean-len`, at most `--max-len` tokens) after
prompts of 64-256 tokens. Each side runs in a process of its own, which is killed and reported out of memory when
its resident memory passes `--mem-cap-gib`, so one side's failure is a figure, not a crash:

    padded   packing off, micro-batches of --micro-rows rows          (the throughput baseline)
    packed   packing on, the same micro-batches                       -> packed_vs_padded_tokens_per_s
    naive    padded, no checkpointing, the log-softmax over the whole vocabulary at once (no chunks)
    baton    packed + activation checkpointing + chunked log-probs   -> memory_ratio_vs_naive (naive out of memory
             where baton fits meets the target; the ratio is then to the cap, an upper bound)
    lora     baton's side with LoRA (rank 16) on the projections    -> lora_memory_ratio_vs_full
    tokens_N packed + checkpointing, one micro-batch of N tokens     -> bytes_per_token_per_layer

Memory is each process's peak resident set; glibc's malloc runs with a fixed mmap threshold (`--mmap-threshold`, 1 MiB:
a freed tensor's pages go back to the system, so the resident set follows the tensors, not what the allocator kept
from earlier ones; 0 keeps glibc's own, sliding threshold, whose retention adds 0.5-1.4 GB per side here and varies run
to run). `step_extra_mib` is what the measured update needed above the process's
memory just before it (a first, tiny update has already allocated gradients and AdamW state). `mfu_vs_matmul` is the
packed side's model FLOP/s (6 x parameters x tokens, attention included, recomputation not) over this machine's
float32 matmul FLOP/s measured at the start of the same run.

    .venv/bin/python bench/scale.py [--quick] [--layers 4] [--json /tmp/scale.json] [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

from common import finish, parser as common_parser

SEED = 0
# Targets (issue 35), ratios of sides measured in the same run.
TARGETS = {"packed_vs_padded_tokens_per_s": 1.5, "memory_ratio_vs_naive": 0.4, "lora_memory_ratio_vs_full": 0.5}


def trace_lengths(rows: int, mean_len: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts uniform in 64..256 (a quarter of that in quick runs' short traces),
    responses log-normal (sigma 0.8) with mean about `mean_len`, clipped to [16, max_len]."""
    g = torch.Generator().manual_seed(seed)
    sigma = 0.8
    mu = math.log(mean_len) - sigma ** 2 / 2
    responses = torch.exp(mu + sigma * torch.randn(rows, generator=g)).clamp(16, max_len).round().long()
    responses[0] = max_len  # one trace at the limit, as a batch of reasoning traces has
    low, high = (64, 256) if mean_len >= 512 else (16, 64)
    prompts = torch.randint(low, high + 1, (rows,), generator=g)
    return list(zip(prompts.tolist(), responses.tolist()))


def grpo_batch(lengths: list[tuple[int, int]], vocab: int, seed: int):
    """A GRPO training batch: random tokens, prompts left-padded and responses right-padded, random advantages."""
    from baton.data import DataProto

    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    prompt_width, response_width = max(p for p, _ in lengths), max(r for _, r in lengths)
    prompts = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.zeros(rows, response_width, dtype=torch.long)
    mask = torch.zeros(rows, prompt_width + response_width, dtype=torch.long)
    for i, (p, r) in enumerate(lengths):
        prompts[i, prompt_width - p:] = torch.randint(4, vocab, (p,), generator=g)
        responses[i, :r] = torch.randint(4, vocab, (r,), generator=g)
        mask[i, prompt_width - p: prompt_width + r] = 1
    return DataProto.from_dict({
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
        "response_mask": mask[:, prompt_width:].clone(),
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, response_width).clone(),
    }, meta_info={"temperature": 1.0})


def model_spec(args) -> dict:
    spec = {"base": "qwen2.5-0.5b-shape", "num_hidden_layers": args.layers}
    if args.vocab:
        spec["vocab_size"] = args.vocab
    return spec


def side_configs(args) -> dict[str, dict]:
    """Each side's StrategyConfig settings, and its batch: the trace batch, or one micro-batch of N tokens."""
    common = {"micro_batch_size_per_worker": args.micro_rows}  # log-prob chunks of the default size
    sides = {
        "padded": {**common, "packing": False},
        "packed": {**common, "packing": True},
        "naive": {**common, "packing": False, "logprob_chunk_size": 1 << 30},
        "baton": {**common, "packing": True, "gradient_checkpointing": True},
        "lora": {**common, "packing": True, "gradient_checkpointing": True,
                 "lora": {"rank": 16, "alpha": 32}},
    }
    for tokens in args.scaling_tokens:
        sides[f"tokens_{tokens}"] = {"packing": True, "gradient_checkpointing": True,
                                     "micro_batch_size_per_worker": None, "tokens": tokens}
    return sides


def run_side(settings: dict, args) -> dict:
    """In this (child) process: build the side's strategy, one tiny update, then the measured one."""
    from baton.rl.losses import PolicyLoss
    from baton.strategy import OptimizerConfig, StrategyConfig
    from baton.strategy.hf import HFStrategy
    import psutil
    import resource

    torch.manual_seed(SEED)
    settings = dict(settings)
    tokens = settings.pop("tokens", None)
    if "lora" in settings:
        from baton.strategy.base import LoraConfig

        settings["lora"] = LoraConfig(**settings["lora"])
    strategy = HFStrategy(StrategyConfig(model=model_spec(args), seed=SEED, optimizer=OptimizerConfig(lr=1e-6),
                                         **settings))
    vocab = strategy.hf_model.config.vocab_size
    if tokens is None:
        lengths = trace_lengths(args.rows, args.mean_len, args.max_len, SEED)
    else:  # one micro-batch of `tokens` tokens, in rows of at most 1,024
        per_row = min(tokens, 1024)
        lengths = [(per_row // 8, per_row - per_row // 8)] * (tokens // per_row)
    loss = PolicyLoss()
    strategy.train_step(grpo_batch([(8, 8)], vocab, SEED + 1), loss)  # allocates gradients and AdamW state
    batch = grpo_batch(lengths, vocab, SEED)
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    strategy.train_step(batch, loss)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    real_tokens = int(batch.batch["attention_mask"].sum())
    trainable = sum(p.numel() for p in strategy.hf_model.parameters() if p.requires_grad)
    return {"seconds": seconds, "tokens": real_tokens, "padded_positions": int(batch.batch["attention_mask"].numel()),
            "tokens_per_s": real_tokens / seconds, "peak_rss_mib": peak / 2 ** 20,
            "step_extra_mib": (peak - before) / 2 ** 20, "model_flops": model_flops(strategy.hf_model, lengths),
            "trainable_parameters": trainable}


def model_flops(model, lengths: list[tuple[int, int]]) -> float:
    """6 x (the non-embedding parameters x tokens + the LM head x response tokens) + the causal attention's
    matmuls (forward 2 x 2 x seq^2/2 x hidden per layer, backward twice that): the model FLOPs of one update."""
    config = model.config
    embedding = config.vocab_size * config.hidden_size
    body = sum(p.numel() for p in model.parameters()) - embedding * (1 if config.tie_word_embeddings else 2)
    flops = 0.0
    for prompt, response in lengths:
        seq = prompt + response
        flops += 6 * body * seq + 6 * embedding * response
        flops += 3 * 2 * seq * seq * config.hidden_size * config.num_hidden_layers  # QK^T and AV, causal half
    return flops


def matmul_flops_per_s(size: int = 2048, repeats: int = 10, dtype: torch.dtype = torch.float32,
                       device: torch.device = torch.device("cpu")) -> float:
    """FLOP/s of square `size` matmuls of `dtype` on `device`, after a warm-up (synchronised on a GPU)."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return repeats * 2 * size ** 3 / (time.perf_counter() - start)


def spawn_side(name: str, settings: dict, args) -> dict:
    """The side in a child process, polled every 50 ms and killed past the memory cap."""
    import psutil

    command = [sys.executable, os.path.abspath(__file__), "--side", name, "--side-settings", json.dumps(settings),
               *args.passthrough]
    env = dict(os.environ)
    if args.mmap_threshold:  # read by glibc's malloc when the process starts
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    process, cap, peak = psutil.Process(child.pid), args.mem_cap_gib * 2 ** 30, 0
    while child.poll() is None:
        try:
            rss = process.memory_info().rss
        except psutil.Error:
            break
        peak = max(peak, rss)
        if rss > cap:
            child.kill()
            child.communicate()
            return {"out_of_memory": True, "cap_gib": args.mem_cap_gib, "peak_rss_mib": peak / 2 ** 20}
        time.sleep(0.05)
    stdout, stderr = child.communicate()
    if child.returncode != 0:
        return {"failed": f"exit {child.returncode}: {stderr.strip().splitlines()[-1] if stderr.strip() else ''}"}
    return json.loads(stdout.strip().splitlines()[-1])


def ratio(a: dict, b: dict, key: str) -> float | None:
    """a[key] / b[key]; None where a side has no such figure (out of memory, failed or skipped: its entry says)."""
    if key not in a or key not in b:
        return None
    return a[key] / b[key]


def main() -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="of the 24 (default 4; quick: 2)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 151,936; quick: 8,192)")
    parser.add_argument("--rows", type=int, default=None, help="responses in the batch (default 8; quick: 4)")
    parser.add_argument("--mean-len", type=int, default=None, help="mean response length (default 1,024; quick: 64)")
    parser.add_argument("--max-len", type=int, default=None, help="longest response (default 4,096; quick: 256)")
    parser.add_argument("--micro-rows", type=int, default=4, help="rows per micro-batch of the trace-batch sides")
    parser.add_argument("--mem-cap-gib", type=float, default=16.0, help="a side past this resident memory is killed")
    parser.add_argument("--mmap-threshold", type=int, default=1 << 20,
                        help="glibc malloc's mmap threshold in the sides' processes, bytes (0: glibc's default)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per side (default: torch's)")
    parser.add_argument("--sides", default=None, help="comma-separated names of the sides to run (default: all)")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # the child process of one side (`spawn_side`)
    parser.add_argument("--side-settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    defaults = ({"layers": 2, "vocab": 8192, "rows": 4, "mean_len": 64, "max_len": 256} if args.quick else
                {"layers": 4, "vocab": 0, "rows": 8, "mean_len": 1024, "max_len": 4096})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.scaling_tokens = [128, 256, 512] if args.quick else [1024, 2048, 4096, 8192]
    args.passthrough = [f"--layers={args.layers}", f"--vocab={args.vocab}", f"--rows={args.rows}",
                        f"--mean-len={args.mean_len}", f"--max-len={args.max_len}", f"--micro-rows={args.micro_rows}"]
    if args.threads:
        args.passthrough.append(f"--threads={args.threads}")
        torch.set_num_threads(args.threads)
    if args.side:
        print(json.dumps(run_side(json.loads(args.side_settings), args)))
        return 0

    matmul = matmul_flops_per_s(1024 if args.quick else 2048)
    print(f"float32 matmul: {matmul / 1e9:.1f} GFLOP/s on {torch.get_num_threads()} threads")
    lengths = trace_lengths(args.rows, args.mean_len, args.max_len, SEED)
    print(f"model: Qwen2.5-0.5B shape, {args.layers} layers, vocabulary {args.vocab or 151936}; batch: {args.rows} "
          f"traces, responses {sorted(r for _, r in lengths)} tokens")
    sides = {}
    wanted = set(args.sides.split(",")) if args.sides else None
    for name, settings in side_configs(args).items():
        if wanted is not None and name not in wanted:
            sides[name] = {"skipped": "not in --sides"}
            continue
        sides[name] = result = spawn_side(name, settings, args)
        shown = ("out of memory" if result.get("out_of_memory") else result.get("failed") or result.get("skipped")
                 or f"{result['tokens_per_s']:8.1f} tokens/s, peak {result['peak_rss_mib']:7.0f} MiB, "
                    f"update needed {result['step_extra_mib']:6.0f} MiB, {result['seconds']:6.1f} s")
        print(f"  {name:12s} {shown}", flush=True)

    scaling = [(int(name.split("_")[1]), side["step_extra_mib"]) for name, side in sides.items()
               if name.startswith("tokens_") and "step_extra_mib" in side]
    slope = None
    if len(scaling) >= 2:  # least squares over the points: MiB per token
        n = len(scaling)
        mean_x, mean_y = sum(x for x, _ in scaling) / n, sum(y for _, y in scaling) / n
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in scaling)
                 / max(sum((x - mean_x) ** 2 for x, _ in scaling), 1e-9))
    packed = sides["packed"]
    figures = {
        "quick": args.quick, "mmap_threshold": args.mmap_threshold,
        "layers": args.layers, "vocab": args.vocab or 151936, "rows": args.rows,
        "lengths": lengths, "matmul_flops_per_s": matmul, "sides": sides,
        "packed_vs_padded_tokens_per_s": ratio(packed, sides["padded"], "tokens_per_s"),
        "memory_ratio_vs_naive": ratio(sides["baton"], sides["naive"], "peak_rss_mib"),
        "lora_memory_ratio_vs_full": ratio(sides["lora"], sides["baton"], "peak_rss_mib"),
        "mfu_vs_matmul": packed["model_flops"] / packed["seconds"] / matmul if "seconds" in packed else None,
        "bytes_per_token_per_layer": slope * 2 ** 20 / args.layers if slope is not None else None,
        "targets": TARGETS,
    }
    # The naive side out of memory where baton's fits meets the memory target too (issue 35); the ratio to the cap
    # is then an upper bound of the real one.
    naive_out = bool(sides["naive"].get("out_of_memory")) and "tokens_per_s" in sides["baton"]
    if naive_out:
        figures["memory_ratio_vs_naive"] = sides["baton"]["peak_rss_mib"] / (args.mem_cap_gib * 1024)
    figures["naive_out_of_memory"] = naive_out
    figures["passed"] = {
        "packed_vs_padded_tokens_per_s": (figures["packed_vs_padded_tokens_per_s"] or 0) >= TARGETS[
            "packed_vs_padded_tokens_per_s"],
        "memory_ratio_vs_naive": naive_out or (figures["memory_ratio_vs_naive"] or 1) <= TARGETS["memory_ratio_vs_naive"],
        "lora_memory_ratio_vs_full": (figures["lora_memory_ratio_vs_full"] or 1) <= TARGETS["lora_memory_ratio_vs_full"],
    }
    for key in ("packed_vs_padded_tokens_per_s", "memory_ratio_vs_naive", "lora_memory_ratio_vs_full", "mfu_vs_matmul",
                "bytes_per_token_per_layer"):
        value = figures[key]
        print(f"{key:32s} {'n/a' if value is None else f'{value:.3g}'}")
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())

"""GPU check: baton's hf strategy and engine on one GPU at real model shapes, in one process, within a time budget.

Needs only torch, transformers and peft (no Ray, no vLLM). Prints one JSON of:

    train           bf16 mixed-precision GRPO updates (float32 parameters, AdamW) of the Qwen2.5-0.5B and -1.5B
                    shapes (random weights) on a batch of reasoning-trace lengths; sides: padded, packed, packed +
                    activation checkpointing, and that with LoRA (rank 16). Each: tokens/s after one warm-up update,
                    MFU (6 x parameters x tokens + attention, recomputation not counted; a LoRA side's frozen weights
                    skip their weight gradients, so its MFU overstates by up to a third) against the GPU's bf16 dense
                    peak (a table by device name; elsewhere the bf16 matmul FLOP/s measured in this run: `peak_source`
                    says which), and the side's peak torch.cuda.max_memory_allocated. A side out of GPU memory is
                    reported, and the run goes on.
    generation      the hf engine's (0.5B shape, bf16 weights) generated tokens/s at 64 and 256 concurrent requests,
                    each request generating exactly its new tokens (no stop token: random weights emit EOS anywhere).
    weight_sync     export_weights of a trained 0.5B strategy into the engine (update_weights) on the same device:
                    seconds, bytes, GB/s, and whether the engine then holds the trained weights (it starts from
                    another seed).
    offload_reload  that strategy's offload and reload (parameters, gradients, AdamW state):
                    torch.cuda.memory_allocated before, after offload and after reload, and the seconds each took.

Each part is skipped ("skipped": "time budget") when it would not finish within --budget-s of the start. Without a CUDA
device it prints {"skipped": "no CUDA device", ...} and exits 0; --dry-run (and --quick without a GPU) runs every part
on the CPU with tiny-qwen2 and a few short rows, so that every code path runs.

    python bench/gpu_check.py [--budget-s 420] [--json /tmp/gpu_check.json] [--dry-run]
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import sys
import time

import torch

from common import finish, parser as common_parser
from scale import grpo_batch, matmul_flops_per_s, model_flops, trace_lengths

SEED = 0
# bf16 dense tensor-core peaks (NVIDIA datasheets, without sparsity); the first name found in the device's name counts.
BF16_PEAK_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
MODELS = {"0.5b": "qwen2.5-0.5b-shape", "1.5b": "qwen2.5-1.5b-shape"}
DRY_MODELS = {"0.5b": {"base": "tiny-qwen2", "num_hidden_layers": 2}, "1.5b": "tiny-qwen2"}
SIDES = {  # StrategyConfig settings beside the shared ones (`strategy_config`)
    "padded": {"packing": False},
    "packed": {"packing": True},
    "packed_ckpt": {"packing": True, "gradient_checkpointing": True},
    "packed_ckpt_lora": {"packing": True, "gradient_checkpointing": True, "lora": {"rank": 16, "alpha": 32}},
}
# Responses in the batch, their mean and longest length, rows per micro-batch, timed updates after the warm-up, and the
# generation's prompt length and new tokens per request.
SIZES = {
    "dry_run": {"rows": 4, "mean_len": 32, "max_len": 64, "micro_rows": 4, "updates": 1, "prompt_len": 8,
                "new_tokens": 4},
    "quick": {"rows": 8, "mean_len": 512, "max_len": 2048, "micro_rows": 4, "updates": 1, "prompt_len": 64,
              "new_tokens": 64},
    "full": {"rows": 16, "mean_len": 1024, "max_len": 4096, "micro_rows": 4, "updates": 2, "prompt_len": 128,
             "new_tokens": 128},
}
ESTIMATE_S = {"0.5b": 30.0, "1.5b": 60.0, "serving": 60.0}  # a part's first guess; later sides use the last one's time


class Budget:
    """Seconds since the start: a part runs only if its estimate still fits; a part out of GPU memory is a figure."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def run(self, estimate_s: float, fn, *args) -> dict:
        if time.perf_counter() - self.start + estimate_s > self.seconds:
            return {"skipped": "time budget"}
        start = time.perf_counter()
        try:
            result = fn(*args)
        except torch.cuda.OutOfMemoryError as error:
            result = {"out_of_memory": str(error).splitlines()[0]}
        free_memory()  # after the except block, which held the failed frames' tensors through the traceback
        result["part_s"] = time.perf_counter() - start
        return result


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def device_info() -> dict:
    import peft
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "cuda_available": torch.cuda.is_available(), "num_devices": torch.cuda.device_count()}
    if torch.cuda.is_available():
        info.update(name=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    return info


def strategy_config(model, settings: dict, args):
    from baton.strategy import OptimizerConfig, StrategyConfig
    from baton.strategy.base import LoraConfig

    settings = dict(settings)
    if "lora" in settings:
        settings["lora"] = LoraConfig(**settings["lora"])
    return StrategyConfig(model=model, dtype="float32", compute_dtype="bfloat16", seed=SEED,
                          optimizer=OptimizerConfig(lr=1e-6), micro_batch_size_per_worker=args.micro_rows, **settings)


def trained_strategy(model, settings: dict, batch, args, device):
    """An hf strategy after one update on `batch` (the warm-up: kernels, allocator pools, gradients, AdamW state)."""
    from baton.rl.losses import PolicyLoss
    from baton.strategy.hf import HFStrategy

    strategy = HFStrategy(strategy_config(model, settings, args), device=device)
    strategy.train_step(batch, PolicyLoss())
    return strategy


def train_side(label: str, side: str, lengths: list[tuple[int, int]], args, device, peak_flops: float) -> dict:
    from baton.models import model_config
    from baton.rl.losses import PolicyLoss

    model = args.models[label]
    batch = grpo_batch(lengths, model_config(model).vocab_size, SEED)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    strategy = trained_strategy(model, SIDES[side], batch, args, device)
    if f"{label}/{side}" == args.simulate_oom:
        raise torch.cuda.OutOfMemoryError(f"simulated for {label}/{side} (--simulate-oom)")
    sync(device)
    start = time.perf_counter()
    for _ in range(args.updates):
        metrics = strategy.train_step(batch, PolicyLoss())
    sync(device)
    seconds = (time.perf_counter() - start) / args.updates
    tokens, flops = int(batch.batch["attention_mask"].sum()), model_flops(strategy.hf_model, lengths)
    return {"tokens": tokens, "padded_positions": int(batch.batch["attention_mask"].numel()),
            "seconds_per_update": seconds, "tokens_per_s": tokens / seconds, "model_flops": flops,
            "mfu": flops / seconds / peak_flops, "loss": metrics["loss"],
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "trainable_parameters": sum(p.numel() for p in strategy.hf_model.parameters() if p.requires_grad)}


def generation(engine, loop, args) -> dict:
    """Generated tokens/s at each concurrency: every request submitted at once, each generating --new-tokens."""
    from baton.engines import GenerationRequest
    from baton.strategy import SamplingParams

    g = torch.Generator().manual_seed(SEED)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=())  # no stop token

    async def generate(num_requests: int, tag: str) -> int:
        prompts = torch.randint(4, min(engine.vocab_size, 1000), (num_requests, args.prompt_len), generator=g)
        requests = [GenerationRequest(f"{tag}-{i}", prompt, dataclasses.replace(params, seed=SEED + i))
                    for i, prompt in enumerate(prompts.tolist())]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return sum(len(r.response_ids) for r in results)

    loop.run_until_complete(generate(8, "warmup"))
    figures = {}
    for concurrency in args.concurrency:
        sync(engine.device)
        start = time.perf_counter()
        tokens = loop.run_until_complete(generate(concurrency, f"c{concurrency}"))
        sync(engine.device)
        seconds = time.perf_counter() - start
        figures[str(concurrency)] = {"requests": concurrency, "new_tokens_per_request": args.new_tokens,
                                     "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    return figures


def weight_sync(strategy, engine, loop) -> dict:
    """The trained strategy's export_weights into the engine (float32 buckets, cast to the engine's bf16 on load)."""
    device = engine.device
    sync(device)
    start = time.perf_counter()
    buckets = list(strategy.export_weights())
    export_s = time.perf_counter() - start
    loop.run_until_complete(engine.update_weights(buckets, version=1))
    sync(device)
    seconds = time.perf_counter() - start
    moved = sum(t.numel() * t.element_size() for bucket in buckets for t in bucket.values())
    ours = engine.model.state_dict()
    synced = all(torch.equal(ours[name], t.to(ours[name].dtype)) for bucket in buckets for name, t in bucket.items())
    return {"seconds": seconds, "export_s": export_s, "import_s": seconds - export_s, "bytes": moved,
            "gb_per_s": moved / seconds / 1e9, "num_buckets": len(buckets), "engine_holds_trained_weights": synced}


def offload_reload(strategy) -> dict:
    device = strategy.device
    tensors = [*strategy.module.parameters(), *(p.grad for p in strategy.module.parameters() if p.grad is not None),
               *(v for state in strategy.optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
    figures = {"state_bytes": sum(t.numel() * t.element_size() for t in tensors), "allocated_before": allocated(device)}
    for step in ("offload", "reload"):
        sync(device)
        start = time.perf_counter()
        getattr(strategy, step)()
        sync(device)
        figures[f"{step}_s"] = time.perf_counter() - start
        figures[f"allocated_after_{step}"] = allocated(device)
    return figures


def serving(lengths: list[tuple[int, int]], args, device, budget: Budget) -> dict:
    """The 0.5B shape's engine generates; a trained 0.5B strategy syncs its weights into it; then that strategy is
    offloaded and reloaded with the engine gone (so the device holds the strategy's memory only)."""
    from baton.engines import HFEngine
    from baton.models import model_config
    from baton.strategy import StrategyConfig

    model = args.models["0.5b"]
    engine = HFEngine.from_config(StrategyConfig(model=model, dtype="bfloat16", seed=SEED + 1), device=device,
                                  max_num_seqs=max(args.concurrency))
    loop = asyncio.new_event_loop()
    try:
        figures = {"generation": budget.run(ESTIMATE_S["serving"] / 2, generation, engine, loop, args)}
        batch = grpo_batch(lengths, model_config(model).vocab_size, SEED)
        strategy = trained_strategy(model, SIDES["packed_ckpt"], batch, args, device)
        figures["weight_sync"] = budget.run(ESTIMATE_S["serving"] / 4, weight_sync, strategy, engine, loop)
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    del engine
    free_memory()
    figures["offload_reload"] = budget.run(ESTIMATE_S["serving"] / 4, offload_reload, strategy)
    return figures


def main() -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU with tiny-qwen2 and short rows")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the parts that would end past this")
    parser.add_argument("--simulate-oom", default="", help="MODEL/SIDE (e.g. 1.5b/padded) raises out of memory (tests)")
    args = parser.parse_args()
    # Freed blocks of any size reusable by the next side (after one out of memory); read before CUDA's first allocation.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    has_gpu = torch.cuda.is_available()
    args.dry_run = args.dry_run or (args.quick and not has_gpu)
    if not has_gpu and not args.dry_run:
        figures = {"skipped": "no CUDA device", "device": device_info(), "quick": args.quick, "passed": {}}
        print(json.dumps(figures, indent=2))
        return finish(figures, args.json, args.check)
    from baton.strategy.hf import default_device

    device = torch.device("cpu") if args.dry_run else default_device()
    budget = Budget(args.budget_s)
    args.size = "dry_run" if args.dry_run else "quick" if args.quick else "full"
    for key, value in SIZES[args.size].items():
        setattr(args, key, value)
    args.models, args.concurrency = DRY_MODELS if args.dry_run else MODELS, [64, 256]
    lengths = trace_lengths(args.rows, args.mean_len, args.max_len, SEED)

    matmul = matmul_flops_per_s(256 if args.dry_run else 8192, 20, torch.bfloat16, device)
    name = device_info().get("name", "")
    table = next((key for key in BF16_PEAK_FLOPS if key in name), None)
    peak_flops = BF16_PEAK_FLOPS[table] if table else matmul
    print(f"{name or 'cpu'}: bf16 matmul {matmul / 1e12:.3g} TFLOP/s; MFU against {peak_flops / 1e12:.3g} TFLOP/s",
          file=sys.stderr)

    def train(label: str) -> dict:
        sides, estimate = {}, ESTIMATE_S[label]
        for side in SIDES:
            sides[side] = result = budget.run(estimate, train_side, label, side, lengths, args, device, peak_flops)
            estimate = result.get("part_s", estimate)
            print(f"  {label} {side:18s} {json.dumps(result)}", file=sys.stderr, flush=True)
        return {"model": args.models[label], "sides": sides}

    figures = {"quick": args.quick, "dry_run": args.dry_run, "device": device_info(), "budget_s": args.budget_s,
               "matmul_bf16_flops_per_s": matmul, "peak_flops": peak_flops,
               "peak_source": f"table: {table}" if table else f"measured bf16 matmul ({device.type})",
               "size": args.size,
               "batch": {"rows": args.rows, "lengths": lengths, "tokens": sum(p + r for p, r in lengths)},
               "train": {"0.5b": train("0.5b")}}
    serving_figures = budget.run(ESTIMATE_S["serving"], serving, lengths, args, device, budget)
    for part in ("generation", "weight_sync", "offload_reload"):  # its own figures, or the group's skip or OOM
        figures[part] = serving_figures.get(part, serving_figures)
    figures["train"]["1.5b"] = train("1.5b")
    figures.update(elapsed_s=time.perf_counter() - budget.start, ray_imported="ray" in sys.modules, passed={})
    print(json.dumps(figures, indent=2))
    return finish(figures, args.json, args.check)


if __name__ == "__main__":
    sys.exit(main())

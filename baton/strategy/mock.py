"""The mock strategy: deterministic outputs and no model, for testing the plumbing of pipelines.

Responses are a fixed function of the prompt and the sample index; every log-prob (and value) is
one learnable scalar, so `train_step` runs a real loss, backward pass and AdamW step on it, and
weight sync and checkpoints have something to carry. `offload` / `reload` act as a device strategy's
would for its caller: while offloaded, every call that reads or writes the weights refuses, so a
pipeline that computes on (or syncs into, or saves) an offloaded role fails.
"""

from __future__ import annotations

import os
import shutil

import torch

from baton.algorithms.aggregation import count_loss_units
from baton.checkpoint import load_state, save_state, writing
from baton.data import DataProto
from baton.data.shards import WeightPiece, fingerprint
from baton.models import load_tokenizer
from baton.strategy.base import LossFn, SamplingParams, StrategyConfig, metric_sum_count
from baton.strategy.sampling import generation_output


class MockStrategy:
    def __init__(self, config: StrategyConfig, device: torch.device | None = None):
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.scalar = torch.nn.Parameter(torch.tensor(-1.0))
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW([self.scalar], lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                           weight_decay=opt.weight_decay)
        self.global_step = 0
        self.offloaded = False

    def _check_on_device(self, method: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"{method}() on an offloaded mock strategy; call reload() first")

    def _outputs(self, batch: DataProto) -> dict[str, torch.Tensor]:
        shape = batch.batch["responses"].shape
        key = "values" if self.config.kind == "value" else "log_probs"
        out = {key: self.scalar.expand(shape)}
        if key == "log_probs":
            out["entropy"] = torch.ones(shape)
        return out

    def forward(self, batch: DataProto, temperature: float = 1.0) -> DataProto:
        self._check_on_device("forward")
        with torch.no_grad():
            return DataProto.from_dict({k: v.clone() for k, v in self._outputs(batch).items()})

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        self._check_on_device("generate")
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        vocab = len(self.tokenizer)
        prompt_ids = prompts.batch["input_ids"].repeat_interleave(params.n, 0)
        rows, max_new = prompt_ids.shape[0], params.max_new_tokens
        responses = torch.full((rows, max_new), pad, dtype=torch.long)
        response_mask = torch.zeros(rows, max_new, dtype=torch.long)
        stopped = []
        for row in range(rows):
            key = int(prompt_ids[row].sum()) + row % params.n + (params.seed or 0)
            length = 1 + key % max_new
            tokens = [(key + 7 * t) % (vocab - 4) + 4 for t in range(length)]
            if length < max_new:
                tokens[-1] = eos
            responses[row, :length] = torch.tensor(tokens)
            response_mask[row, :length] = 1
            stopped.append(length < max_new)
        log_probs = self.scalar.detach().expand(rows, max_new) * response_mask
        return generation_output(prompts, params, responses, response_mask, log_probs, torch.tensor(stopped))

    def train_step(self, batch: DataProto, loss_fn: LossFn, loss_unit: str = "token") -> dict[str, float]:
        self._check_on_device("train_step")
        units = float(count_loss_units(batch.batch["response_mask"], loss_unit))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, metrics = loss_fn(self._outputs(batch), batch)
        loss = loss_sum / max(units, 1.0)
        loss.backward()
        grad_norm = float(self.scalar.grad.abs()) if self.scalar.grad is not None else 0.0
        self.optimizer.step()
        self.global_step += 1
        sums_counts = {key: metric_sum_count(value) for key, value in metrics.items()}
        return {"loss": float(loss.detach()), "grad_norm": grad_norm, "lr": self.config.optimizer.lr,
                **{key: total / max(count, 1.0) for key, (total, count) in sums_counts.items()}}

    def export_weights(self, bucket_bytes: int = 256 << 20):
        self._check_on_device("export_weights")
        yield {"scalar": self.scalar.detach().clone()}

    def weight_pieces(self):
        self._check_on_device("export_weights")
        yield WeightPiece("scalar", self.scalar.detach().clone(), tuple(self.scalar.shape), self.scalar.dtype)

    def import_weights(self, buckets) -> None:
        self._check_on_device("import_weights")
        for bucket in buckets:
            if set(bucket) != {"scalar"}:
                raise ValueError(f"the mock strategy holds one weight, 'scalar'; got {sorted(bucket)}")
            self.scalar.data.copy_(bucket["scalar"])

    def weight_fingerprints(self, names: list[str]) -> dict[str, int] | None:
        return {name: fingerprint(self.scalar) for name in names if name == "scalar"}

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.scalar.dtype

    def offload(self) -> None:
        """Nothing lives on an accelerator; until `reload`, the calls that touch the weights refuse."""
        self.offloaded = True

    def reload(self) -> None:
        self.offloaded = False

    def save_checkpoint(self, path: str, overwrite: bool = False) -> None:
        """One state file, `mock_state.state`, in a directory written under a temporary name and renamed."""
        self._check_on_device("save_checkpoint")
        if os.path.exists(path) and not overwrite:
            raise FileExistsError(f"checkpoint {path} exists; pass overwrite=True or choose another path")
        partial = path + ".partial"
        with writing(path, partial):
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            save_state(os.path.join(partial, "mock_state.state"),
                       {"scalar": self.scalar.detach(), "optimizer": self.optimizer.state_dict(),
                        "global_step": self.global_step})
            shutil.rmtree(path, ignore_errors=True)
            os.replace(partial, path)

    def load_checkpoint(self, path: str) -> None:
        self._check_on_device("load_checkpoint")
        state = load_state(os.path.join(path, "mock_state.state"))
        self.scalar.data.copy_(state["scalar"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_step = state["global_step"]

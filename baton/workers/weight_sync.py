"""Weight sync from a training cluster to an inference cluster (ROLL's model-update pair), checked after every sync.

The source cluster's rank 0 puts the full weights, a bucket at a time, in Ray's object store (all
ranks help gather sharded weights); every destination worker fetches the buckets itself, so the
clusters may differ in world size and strategy and the driver only ever holds references. When
the two roles share a process (`create_colocated_clusters`) the destination points its parameters
at the source's tensors instead: nothing is copied.
"""

from __future__ import annotations

import time

from baton.data import DataProto
from baton.distributed import Cluster


class WeightSyncError(RuntimeError):
    """After a sync the destination's log-probs disagree with the source's."""


class ModelUpdatePair:
    """`src` → `dst`; both are clusters of `ModelWorker`s (the destination a `RolloutWorker` when sharing).

    probe: a small batch (input_ids, attention_mask, responses, response_mask) on which both sides'
        log-probs must agree within `atol` after each sync; None skips the check. float32 models
        on matching strategies agree to ~1e-6; raise `atol` for bf16 or a different inference engine.
    share_role: the source's role name when the two are colocated in one process: share, don't copy.
        A sharing pair is probed on its first sync only: from then on both sides hold the same tensors.
    adapter_only: send only a LoRA source's adapter (`export_adapter` -> `import_adapter`), which the destination
        serves on its own copy of the base; the probe then checks that the destination serves it.
    """

    def __init__(self, src: Cluster, dst: Cluster, probe: DataProto | None = None, atol: float = 1e-4,
                 bucket_bytes: int = 256 << 20, share_role: str | None = None, adapter_only: bool = False):
        assert not (adapter_only and share_role is not None), "a shared model has no adapter of its own to send"
        self.src, self.dst, self.probe, self.atol = src, dst, probe, atol
        self.bucket_bytes, self.share_role, self.adapter_only = bucket_bytes, share_role, adapter_only
        self.num_syncs = 0

    def source_log_probs(self):
        """The source's log-probs on the probe's tokens (what `check` compares the destination's with)."""
        return self.src.compute_log_probs(self.probe).batch["log_probs"]

    def sync(self) -> dict[str, float]:
        start = time.perf_counter()
        if self.share_role is not None:
            self.dst.share_weights_with(self.share_role)
        elif self.adapter_only:
            self.dst.import_adapter(self.src.export_adapter())
        else:
            self.dst.import_weights(self.src.export_weights(self.bucket_bytes))
        metrics = {"timing_s/weight_sync": time.perf_counter() - start}
        if self.probe is not None and (self.share_role is None or self.num_syncs == 0):
            metrics["weight_sync/max_logprob_diff"] = self.check()
        self.num_syncs += 1
        return metrics

    def check(self, ours=None) -> float:
        """Largest |log p_src - log p_dst| on the probe's response tokens; raises `WeightSyncError` above `atol`.
        ours: the source's log-probs on the probe, computed before (`source_log_probs`), e.g. while the destination
        was still busy; else computed here."""
        ours = self.source_log_probs() if ours is None else ours
        theirs = self.dst.compute_log_probs(self.probe).batch["log_probs"]
        mask = self.probe.batch["response_mask"].bool()
        diff = float((ours - theirs).abs().masked_fill(~mask, 0.0).max()) if mask.any() else 0.0
        if not diff <= self.atol:  # also catches NaN
            raise WeightSyncError(
                f"after syncing {self.src.name!r} → {self.dst.name!r} their log-probs differ by up to {diff:.3g} "
                f"(tolerance {self.atol:g}) on the probe batch: the destination did not receive the trained weights"
            )
        return diff


def probe_batch(tokenizer, texts: list[str], response_len: int) -> DataProto:
    """A probe from plain texts: each text's last `response_len` tokens are the response (texts left-padded)."""
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
    if input_ids.shape[1] <= response_len:
        raise ValueError(f"probe texts need more than response_len={response_len} tokens")
    responses = input_ids[:, -response_len:]
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask, "responses": responses,
        "response_mask": attention_mask[:, -response_len:].clone(), "prompts": input_ids[:, :-response_len],
    }, meta_info={"temperature": 1.0})


__all__ = ["ModelUpdatePair", "WeightSyncError", "probe_batch"]

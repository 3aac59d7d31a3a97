"""The `vllm` rollout (`strategy.name: vllm`): the batch pipelines' rollout on the `vllm` engine. Its `generate` is the
batch adapter over any engine (`baton.engines.batch`); the log-probs of given responses (the sync probe) come from
vLLM's prompt log-probs. It lives with the engines, not with the strategies it stands in for, so that the strategy
layer imports no engine; the strategy registry names it by import path.

A rollout is asked for what `RolloutWorker` and `ModelWorker` call on it: `generate`, `forward` (through
`compute_log_probs`: the weight-sync probe), `import_weights` (the sync), `offload` / `reload`, and the sampling
generator's state (`generator`, for exact resume). vLLM trains nothing and its weights come from the actor, so
`train_step`, `export_weights`, `save_checkpoint`, `load_checkpoint` and `share_weights_from` do not exist here;
a call to one raises an AttributeError that says where to do it instead (the config checks refuse `vllm` for the
actor, critic and reference roles before any worker starts).

Import this module anywhere; vLLM itself is imported when a `VLLMRollout` is built (`scripts/setup.sh --vllm`).
"""

from __future__ import annotations

import importlib.util
import itertools
from typing import Iterable

import torch

from baton.data import DataProto
from baton.engines.batch import generate_batch
from baton.engines.loop import LoopThread
from baton.engines.protocol import ServedEngine
from baton.models import load_tokenizer
from baton.strategy.base import SamplingParams, StrategyConfig

INSTALL_HINT = "install it with scripts/setup.sh --vllm"

# What a rollout on vLLM does not do, and where it is done instead.
_ELSEWHERE = {
    "train_step": "vLLM only generates; train with strategy 'hf' or 'fsdp2' (the actor)",
    "export_weights": "a rollout's weights are the actor's; export them from the actor",
    "save_checkpoint": "a rollout's weights are the actor's; the pipelines checkpoint the actor",
    "load_checkpoint": "start the rollout from a checkpoint with strategy.model: <its directory>",
    "share_weights_from": "vLLM holds its own copy of the weights; the weight sync copies them (export_weights -> "
                          "import_weights), colocated or not",
}


def require_vllm() -> None:
    """Raise ImportError, with the install command, where vLLM is not installed (without importing it)."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"the 'vllm' strategy needs vLLM, which is not installed; {INSTALL_HINT}")


def serve(config: StrategyConfig, max_num_seqs: int = 256) -> ServedEngine:
    """The `vllm` backend's engine for the rollout system (its `Capabilities.engine`): a rollout's engine and event
    loop, and its `forward` (vLLM's prompt log-probs) for the sync probe."""
    rollout = VLLMRollout(config, max_num_seqs=max_num_seqs)
    return ServedEngine(rollout.engine, rollout.runner, rollout.forward)


class VLLMRollout:
    """A rollout on a `VLLMEngine` (vLLM in this process; see `baton.engines.vllm`); implements `RolloutStrategy`.

    generate: `generate_batch` over the engine: one request per sample (`params.n` consecutive rows per prompt), all
        in flight at once, so vLLM batches them continuously. Request `k` of a call samples with its own seed: the
        k-th draw of a generator seeded with `params.seed`, or of `self.generator` (seeded by `config.seed`, saved
        with checkpoints by the rollout worker) when `params.seed` is None. top-k / top-p with temperature > 0 are
        refused by the engine (vLLM reports the filtered distribution's log-probs).
    forward: log p(response token) at `temperature` from vLLM's prompt log-probs of prompt + response (float32
        matches an HF forward to ~1e-6). vLLM applies no temperature to prompt log-probs, so a temperature other
        than 0 or 1 asks for the whole vocabulary's log-probs at each token and rescales them (vocabulary-size
        Python objects per token: cheap on small vocabularies, slow on 150k ones). No entropy (only training uses it).
    import_weights: all buckets in one in-place reload (`VLLMEngine.update_weights`: the tied LM head is sent too,
        running requests recompute their KV cache); each import is a new weight version.
    import_adapter: a LoRA actor's adapter (peft's tensors and config) served on the base weights
        (`VLLMEngine.update_adapter`, which needs `engine_kwargs: {enable_lora: true, max_lora_rank: ...}`): a new
        weight version whose adapter every later generate and forward runs with, so the sync probe scores it.
    offload / reload: vLLM's sleep / wake-up; on CPU vLLM has no sleep mode and both free nothing.
    engine_kwargs: passed to `VLLMEngine.from_config` (e.g. `kv_cache_memory_bytes`, `max_num_seqs`), over the config's
        `engine_kwargs` (what a YAML file sets: `rollout.strategy.engine_kwargs`).
    A rollout worker of several GPUs (`num_devices_per_worker` > 1) runs one engine, tensor parallel over all of them
    (`VLLMEngine`'s `tensor_parallel_size` defaults to the GPUs the process sees); to the pipeline it is one
    data-parallel worker.
    """

    def __init__(self, config: StrategyConfig, **engine_kwargs):
        require_vllm()
        from baton.engines.vllm import VLLMEngine

        if config.kind != "causal_lm":
            raise ValueError(f"the 'vllm' strategy generates with a causal LM; strategy.kind is {config.kind!r}")
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        # max_logprobs -1: forward at a temperature other than 1 needs the whole vocabulary's prompt log-probs.
        self.engine = VLLMEngine.from_config(config, **{"max_logprobs": -1, **config.engine_kwargs, **engine_kwargs})
        self.generator = torch.Generator().manual_seed(config.seed)  # per-request seeds when params.seed is None
        # One event loop for every call, in a thread of its own: the engine's scheduler task lives on it between
        # calls, and a rollout engine worker (`baton.rollout.engine_worker`) serves requests on it.
        self.runner = LoopThread("vllm-strategy")
        self._request_ids = itertools.count()
        self._sleeping = False

    def __getattr__(self, name: str):
        if name in _ELSEWHERE:
            raise AttributeError(f"the 'vllm' strategy has no {name}: {_ELSEWHERE[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def close(self) -> None:
        """Stop the engine and free its memory (and a checkpoint it wrote); the strategy serves nothing after. A
        strategy never closed (a worker's, whose process ends with the run) is freed by the process's exit."""
        if not self.runner.loop.is_closed():
            self.runner.run(self.engine.close())
            self.runner.close()

    # --- generation ---------------------------------------------------------------------------------

    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        self._check_awake("generate")
        return generate_batch(self.engine, self.runner, prompts, params, generator=self.generator,
                              pad_token_id=self.tokenizer.pad_token_id,
                              call_id=f"generate-{next(self._request_ids)}")  # a worker call: call_timeout_s bounds it

    # --- log-probs of given responses ---------------------------------------------------------------

    def forward(self, batch: DataProto, temperature: float = 1.0) -> DataProto:
        """log_probs [rows, response_len] of `responses` after the prompt part of `input_ids` (real tokens: where
        attention_mask is 1; responses right-padded), 0 on response padding."""
        self._check_awake("forward")
        input_ids, attention_mask = batch.batch["input_ids"].cpu(), batch.batch["attention_mask"].cpu()
        responses = batch.batch["responses"].cpu()
        response_len = responses.shape[1]
        response_mask = attention_mask[:, input_ids.shape[1] - response_len:]  # [rows, response_len]
        lengths = response_mask.sum(-1)
        if bool((response_mask != (torch.arange(response_len) < lengths[:, None])).any()):
            raise ValueError("forward needs right-padded responses: attention_mask over the response columns must be "
                             "1s then 0s")
        if bool((attention_mask[:, : input_ids.shape[1] - response_len].sum(-1) == 0).any()):
            raise ValueError("forward needs at least one prompt token per row: the first response token is scored "
                             "given the tokens before it")
        sequences = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
        greedy_or_one = temperature in (0.0, 1.0)  # greedy samples report temperature-1 log-probs
        per_row = self.runner.run(self.engine.run_on_engine(
            self._prompt_log_probs, sequences, lengths.tolist(), None if greedy_or_one else temperature), timeout_s=None)
        log_probs = torch.zeros(len(batch), response_len, dtype=torch.float32)
        for row, values in enumerate(per_row):
            log_probs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return DataProto.from_dict({"log_probs": log_probs})

    def _prompt_log_probs(self, llm, sequences: list[list[int]], num_scored: list[int],
                          temperature: float | None) -> list[list[float]]:
        """In the engine's thread, between its steps (`llm`: vLLM's LLMEngine; the Engine protocol has no scoring, so
        these requests go to vLLM directly): log p(token | tokens before) of each sequence's last
        `num_scored` tokens, at `temperature` (None: 1). vLLM's prompt log-probs are a log-softmax of the raw logits;
        at another temperature the whole vocabulary's are rescaled: log_softmax(raw / T)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        assert not llm.has_unfinished_requests(), "generate and forward calls do not overlap"
        params = VLLMSamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                    prompt_logprobs=0 if temperature is None else -1,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        call = next(self._request_ids)
        request_ids = [f"score-{call}-{row}" for row in range(len(sequences))]
        for request_id, sequence in zip(request_ids, sequences):
            llm.add_request(request_id, {"prompt_token_ids": sequence}, params, lora_request=self.engine.lora_request)
        prompt_log_probs = {}
        while llm.has_unfinished_requests():
            for output in llm.step():
                if output.prompt_logprobs is not None:
                    prompt_log_probs[output.request_id] = output.prompt_logprobs
        values = []
        for request_id, sequence, count in zip(request_ids, sequences, num_scored):
            positions = prompt_log_probs[request_id][len(sequence) - count:]  # [count] dicts {token id: Logprob}
            tokens = sequence[len(sequence) - count:]
            if temperature is None:
                values.append([position[token].logprob for position, token in zip(positions, tokens)])
                continue
            row = []
            for position, token in zip(positions, tokens):
                ids = list(position)
                scaled = torch.tensor([position[i].logprob for i in ids], dtype=torch.float64) / temperature
                row.append(float(scaled[ids.index(token)] - torch.logsumexp(scaled, 0)))
            values.append(row)
        return values

    # --- weights and memory -------------------------------------------------------------------------

    def import_weights(self, buckets: Iterable[dict[str, torch.Tensor]]) -> None:
        """Every bucket in one in-place reload (see `VLLMEngine.update_weights`), as weight version + 1."""
        self._check_awake("import_weights")
        self.runner.run(self.engine.update_weights(buckets, self.engine.weight_version + 1))

    def weight_fingerprints(self, names: list[str]) -> None:
        """None: vLLM holds its weights fused and resharded under its own names; a sync into it is probe-checked."""
        return None

    @property
    def weight_dtype(self) -> None:
        """None: a sync sends the weights as the source holds them, and vLLM casts them as it loads."""
        return None

    def import_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
        """Serve the base weights with this LoRA adapter (peft's names and adapter_config.json; see
        `VLLMEngine.update_adapter`), as weight version + 1."""
        self._check_awake("import_adapter")
        self.runner.run(self.engine.update_adapter(tensors, adapter_config, self.engine.weight_version + 1))

    def offload(self) -> None:
        """vLLM's sleep (weights to CPU memory, KV cache freed) on a GPU; on CPU it frees nothing. Until `reload`,
        generate, forward and import_weights refuse."""
        self.runner.run(self.engine.sleep())
        self._sleeping = True

    def reload(self) -> None:
        self.runner.run(self.engine.wake_up())
        self._sleeping = False

    def _check_awake(self, method: str) -> None:
        if self._sleeping:
            raise RuntimeError(f"{method}() on an offloaded vllm rollout; call reload() first")


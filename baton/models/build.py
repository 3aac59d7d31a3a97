"""Model construction: tiny Qwen2 configs for CPU tests and benchmarks, and HF checkpoints from local directories."""

from __future__ import annotations

import inspect
import json
import os
import warnings
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from baton.models.tokenizer import CHAR_VOCAB_SIZE, SPECIAL_TOKENS

# Every registry entry pairs with the shipped character tokenizer.
_CHAR_TOKENIZER_KWARGS: dict[str, Any] = {
    "vocab_size": CHAR_VOCAB_SIZE,
    "pad_token_id": SPECIAL_TOKENS.index("<pad>"),
    "eos_token_id": SPECIAL_TOKENS.index("<eos>"),
    "bos_token_id": SPECIAL_TOKENS.index("<bos>"),
    "tie_word_embeddings": True,
    "dtype": "float32",
    "attn_implementation": "sdpa",
}

# name -> Qwen2Config kwargs.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # ~0.8M parameters: trains on an arithmetic task on 2 CPU cores in minutes.
    "tiny-qwen2": {
        **_CHAR_TOKENIZER_KWARGS,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    },
    # ~7.9M parameters: benchmarks.
    "small-qwen2": {
        **_CHAR_TOKENIZER_KWARGS,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
    },
    # The shapes of Qwen2.5-0.5B and -1.5B (random weights: throughput and memory figures need no trained ones; the
    # character tokenizer's ids are a subset of the vocabulary). bench/scale.py and bench/gpu_check.py build them.
    "qwen2.5-0.5b-shape": {
        **_CHAR_TOKENIZER_KWARGS,
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
    "qwen2.5-1.5b-shape": {
        **_CHAR_TOKENIZER_KWARGS,
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
}

# Qwen2Config stores unknown kwargs as attributes without complaint, so a typo ("hiden_size")
# would silently build the default size. Accept its own fields plus the kwargs PreTrainedConfig
# consumes (and the legacy rope keys it converts to `rope_parameters`).
_CONFIG_KEYS = {
    name for name, param in inspect.signature(Qwen2Config).parameters.items() if param.kind is not param.VAR_KEYWORD
} | {"dtype", "attn_implementation", "rope_theta", "rope_scaling"}


# A dict model is built at random on the CPU before anything else runs: each size is bounded, and so is the parameter
# count they make (a dict's "max_parameters" raises that bound), so that a typo such as 1e8 layers is refused at once
# instead of allocating for minutes.
MAX_MODEL_SIZES = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 20,
                   "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
                   "max_position_embeddings": 1 << 24}
MAX_PARAMETERS = 20_000_000_000  # above Qwen2Config's own defaults (12B)
_QWEN2_DEFAULTS = {name: param.default for name, param in inspect.signature(Qwen2Config).parameters.items()}


def check_model_size(kwargs: dict[str, Any], max_parameters: float = MAX_PARAMETERS) -> int:
    """The parameter count (embeddings, attention, MLP, norms) of Qwen2Config `kwargs`, its unset sizes Qwen2Config's
    defaults; ValueError naming the key for a size that is not a whole number in 1..MAX_MODEL_SIZES[key], or for a
    count above `max_parameters`. Nothing is allocated."""
    sizes = {}
    for key, bound in MAX_MODEL_SIZES.items():
        value = kwargs.get(key, _QWEN2_DEFAULTS[key])
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"{key} is {value!r}; it must be a whole number from 1 to {bound}")
        sizes[key] = value
    if sizes["hidden_size"] % sizes["num_attention_heads"]:
        raise ValueError(f"hidden_size {sizes['hidden_size']} is not a multiple of num_attention_heads "
                         f"{sizes['num_attention_heads']}")
    hidden, head_dim = sizes["hidden_size"], sizes["hidden_size"] // sizes["num_attention_heads"]
    attention = 2 * hidden * hidden + 2 * hidden * sizes["num_key_value_heads"] * head_dim  # q, o; k, v
    per_layer = attention + 3 * hidden * sizes["intermediate_size"] + 2 * hidden
    tied = kwargs.get("tie_word_embeddings", _QWEN2_DEFAULTS["tie_word_embeddings"])
    count = (1 if tied else 2) * sizes["vocab_size"] * hidden + sizes["num_hidden_layers"] * per_layer + hidden
    if count > max_parameters:
        raise ValueError(f"these sizes make a model of {count / 1e9:.1f}B parameters, more than max_parameters "
                         f"{max_parameters / 1e9:g}B built at random on the CPU; check the sizes, or set "
                         "max_parameters in the model dict to build it anyway")
    return count


def _registry_entry(name: str) -> dict[str, Any]:
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; valid names: {sorted(MODEL_CONFIGS)}")
    return MODEL_CONFIGS[name]


def model_config(name_or_dict: str | dict[str, Any]) -> Qwen2Config:
    """A fresh Qwen2Config from a MODEL_CONFIGS name, or from a dict of Qwen2Config kwargs.

    A dict may hold "base": a MODEL_CONFIGS name whose kwargs the dict's other keys override,
    e.g. `{"base": "tiny-qwen2", "num_hidden_layers": 2}`. Without "base" the dict is passed to
    Qwen2Config as is, so unset keys take Qwen2Config's (7B-sized) defaults. Its sizes are checked before
    anything is built (`check_model_size`); "max_parameters" raises the bound on the parameter count.
    """
    if isinstance(name_or_dict, str):
        kwargs = dict(_registry_entry(name_or_dict))
    else:
        overrides = dict(name_or_dict)
        base = overrides.pop("base", None)
        max_parameters = overrides.pop("max_parameters", MAX_PARAMETERS)
        if isinstance(max_parameters, bool) or not isinstance(max_parameters, (int, float)) or not max_parameters > 0:
            raise ValueError(f"max_parameters is {max_parameters!r}; give a positive number")
        kwargs = {**(_registry_entry(base) if base is not None else {}), **overrides}
        unknown = sorted(set(kwargs) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown Qwen2Config keys {unknown}; valid keys: {sorted(_CONFIG_KEYS)}")
        check_model_size(kwargs, max_parameters)
    return Qwen2Config(**kwargs)


def max_position_embeddings(model: str | dict[str, Any]) -> int | None:
    """The `max_position_embeddings` of a model (MODEL_CONFIGS name, dict, or HF directory whose config.json states
    it), else None."""
    if isinstance(model, dict) or model in MODEL_CONFIGS:
        return model_config(model).max_position_embeddings
    try:
        with open(os.path.join(model, "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return positions if isinstance(positions, int) and not isinstance(positions, bool) else None


def build_model(
    model: str | dict[str, Any], *, dtype: torch.dtype = torch.float32, seed: int | None = None
) -> PreTrainedModel:
    """Build a causal LM on the CPU, in `dtype`.

    `model` is one of:
    - a local directory holding an HF checkpoint (config.json + safetensors): loaded with
      `from_pretrained`, local files only; a `seed` is ignored with a warning.
    - a MODEL_CONFIGS name or a dict accepted by `model_config`: randomly initialised. With a
      `seed` the weights depend on the seed alone and the caller's RNG state is left untouched;
      without one they are drawn from (and advance) the global CPU RNG.

    Either way the model comes back in train mode, as `from_config` builds it (`from_pretrained`
    alone would return eval mode); call `.eval()` for inference.
    """
    if isinstance(model, str) and os.path.isdir(model):
        if seed is not None:
            warnings.warn(f"seed={seed} is ignored: the weights of {model!r} are loaded from disk", stacklevel=2)
        return AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=dtype).train()
    if isinstance(model, str) and model not in MODEL_CONFIGS:
        raise ValueError(
            f"model {model!r} is neither a local directory nor a MODEL_CONFIGS name; pass a directory holding "
            f"an HF checkpoint (config.json + safetensors), one of {sorted(MODEL_CONFIGS)}, or a dict of "
            "Qwen2Config kwargs"
        )
    config = model_config(model)
    if seed is None:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Weights are initialised on the CPU, so only the CPU generator is seeded and restored;
    # torch.manual_seed would also reseed (and fork_rng would initialise) every CUDA device.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters; tied weights (embedding and LM head) count once."""
    return sum(p.numel() for p in model.parameters())

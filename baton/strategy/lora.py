"""LoRA on a training role through peft: the adapter put on the model, its weights merged for export, its files.

peft injects its layers into the transformers model in place, so the strategy keeps running that model (`hf_model`,
whose targeted Linears now add the adapter) and keeps the `PeftModel` beside it for what only peft does: switch the
adapter off (the reference), and save and load the adapter in peft's format (adapter_model.safetensors and
adapter_config.json, which peft and vLLM load).
"""

from __future__ import annotations

import os
import warnings

import torch

from baton.strategy.base import LoraConfig

ADAPTER = "default"  # peft's name for a model's one adapter
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def add_lora(model: torch.nn.Module, config: LoraConfig, seed: int):
    """`model` with a LoRA adapter injected (in place), every other parameter frozen; returns the `PeftModel`.
    The adapter's A matrices are drawn from `seed` (B starts at 0), so a seed gives the same adapter every time."""
    import peft

    missing = sorted(set(config.target_modules) - linear_names(model))
    if missing:
        raise ValueError(f"lora target_modules {missing} are not Linear layers of this model; its Linear layers are "
                         f"{sorted(linear_names(model))}")
    settings = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules),
                               lora_dropout=config.dropout, bias="none")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # CPU generator only, as `build_model`'s
        torch.manual_seed(seed)
        # peft asks transformers 5 for a flag under its deprecated name; nothing the user can act on.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        peft_model = peft.get_peft_model(model, settings)
    assert peft_model.base_model.model is model  # injected in place: the strategy keeps running `model`
    return peft_model


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last parts of the names of `model`'s Linear layers (`q_proj`, ...), which LoRA target_modules name."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The adapted layers of `model` by their module name (`model.layers.0.self_attn.q_proj`)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights in its plain HF names with each adapted weight merged, W + scale · B A (what peft's
    `merge_and_unload` would hold), computed beside the model: nothing in it changes. Tied weights (the embeddings
    and an LM head) keep one shared tensor, as in HF's own state dict."""
    layers = lora_layers(model)
    state = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        module_name, _, leaf = name.replace(".base_layer.", ".").rpartition(".")
        layer = layers.get(module_name)
        if layer is not None and leaf == "weight":
            tensor = tensor + layer.get_delta_weight(ADAPTER).to(tensor.dtype)
        state[f"{module_name}.{leaf}"] = tensor
    return state


def adapter_state(peft_model) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter as `save_adapter` writes it, in memory: its tensors in peft's names (copies) and the dict of
    adapter_config.json, for an engine that serves adapters (vLLM)."""
    from peft import get_peft_model_state_dict

    tensors = {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(peft_model).items()}
    config = {name: sorted(value) if isinstance(value, set) else value
              for name, value in peft_model.peft_config[ADAPTER].to_dict().items()}
    return tensors, {**config, "inference_mode": True}


def save_adapter(peft_model, directory: str) -> None:
    """The adapter in peft's format: adapter_model.safetensors and adapter_config.json."""
    peft_model.save_pretrained(directory, safe_serialization=True)


def load_adapter(peft_model, directory: str) -> None:
    """The adapter weights saved by `save_adapter` into `peft_model`; ValueError where they do not fit its adapter
    (another rank or other target modules)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(os.path.join(directory, ADAPTER_WEIGHTS))
    own = get_peft_model_state_dict(peft_model)
    shapes = {name: tuple(t.shape) for name, t in saved.items()}
    if shapes != {name: tuple(t.shape) for name, t in own.items()}:
        different = sorted(set(saved) ^ set(own)) or sorted(n for n in saved if shapes[n] != tuple(own[n].shape))
        raise ValueError(f"the adapter in {directory} does not fit this role's lora settings (rank, target_modules): "
                         f"it differs at {different[:3]}; load it with the lora settings of the run that saved it")
    set_peft_model_state_dict(peft_model, saved)


def has_adapter(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, ADAPTER_CONFIG))

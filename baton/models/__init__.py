"""Models and tokenizers: the shipped character tokenizer, tiny Qwen2 configs, and local HF checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton._lazy import lazy_exports

# Exported name -> the module that defines it, imported on first use: a process that only needs the tokenizer
# (the driver, a reward worker) does not pay for transformers' model code (~2 CPU-s).
_EXPORTS = {
    **{name: "baton.models.build" for name in (
        "MODEL_CONFIGS", "build_model", "count_parameters", "max_position_embeddings", "model_config")},
    **{name: "baton.models.tokenizer" for name in (
        "CHAR_TOKENIZER_DIR", "build_char_tokenizer", "load_tokenizer", "save_tokenizer")},
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from baton.models.build import MODEL_CONFIGS, build_model, count_parameters, max_position_embeddings, model_config
    from baton.models.tokenizer import CHAR_TOKENIZER_DIR, build_char_tokenizer, load_tokenizer, save_tokenizer


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

"""Models and tokenizers: the shipped character tokenizer, tiny Qwen2 configs, and local HF checkpoints."""

from baton.models.build import MODEL_CONFIGS, build_model, count_parameters, model_config
from baton.models.tokenizer import CHAR_TOKENIZER_DIR, build_char_tokenizer, load_tokenizer, save_tokenizer

__all__ = [
    "CHAR_TOKENIZER_DIR", "MODEL_CONFIGS", "build_char_tokenizer", "build_model", "count_parameters", "load_tokenizer",
    "model_config", "save_tokenizer",
]

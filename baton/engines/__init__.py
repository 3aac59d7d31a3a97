"""Inference engines: request-level async generation with continuous batching (`protocol`), and its backends:
`hf` (the shipped sampling loop, batched continuously) and `vllm`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton._lazy import lazy_exports

_EXPORTS = {
    **{name: "baton.engines.protocol" for name in (
        "Engine", "EngineHealth", "FinishReason", "GenerationRequest", "GenerationResult")},
    "HFEngine": "baton.engines.hf",
    "VLLMEngine": "baton.engines.vllm",  # imports vllm only when used (scripts/setup.sh --vllm installs it)
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from baton.engines.hf import HFEngine
    from baton.engines.protocol import Engine, EngineHealth, FinishReason, GenerationRequest, GenerationResult
    from baton.engines.vllm import VLLMEngine


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

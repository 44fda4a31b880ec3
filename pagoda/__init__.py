"""pagoda: an LLM inference and serving engine with PagedAttention and continuous batching.

The public offline API mirrors vLLM's: ``from pagoda import LLM, SamplingParams``. Names are
imported on first use, so importing a submodule does not load the whole engine.
"""
import importlib

__version__ = "0.1.0"
_PUBLIC = {
    "LLM": "pagoda.llm",
    "SamplingParams": "pagoda.sampling_params",
    "BeamSearchParams": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.sampling_params",
    "RequestOutput": "pagoda.outputs",
    "CompletionOutput": "pagoda.outputs",
    "PoolingParams": "pagoda.pooling_params",
    "PoolingRequestOutput": "pagoda.outputs",
    "EmbeddingRequestOutput": "pagoda.outputs",
    "ClassificationRequestOutput": "pagoda.outputs",
    "ScoringRequestOutput": "pagoda.outputs",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")

"""kvserve: an LLM inference engine built around the KV cache."""

# First: it sets the OpenMP wait policy, which libgomp reads once, when torch or a C kernel loads it.
import kvserve.threads  # noqa: F401
from kvserve.config import EngineConfig
from kvserve.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "EmbeddingOutput", "EmbeddingRequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; loading it lazily keeps `import kvserve.core...` torch-free.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")

from kvserve.attention.backend import (FP8, FP8_MAX, AttentionBackend, AttentionMetadata, get_backend, quantize_fp8,
                                       register_backend)
from kvserve.attention import cpu_backend, torch_backend  # noqa: F401  (they register themselves)
from kvserve.attention.layer import Attention, set_attention_backend

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "FP8", "FP8_MAX", "get_backend",
           "quantize_fp8", "register_backend", "set_attention_backend"]

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, get_backend, register_backend
from kvserve.attention import cpu_kernel, torch_backend  # noqa: F401  (torch_backend registers "torch")
from kvserve.attention.layer import Attention, set_attention_backend

__all__ = ["Attention", "cpu_kernel", "AttentionBackend", "AttentionMetadata", "get_backend", "register_backend",
           "set_attention_backend"]

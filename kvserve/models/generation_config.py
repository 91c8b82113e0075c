"""The model's own sampling defaults (vLLM's `--generation-config`), read in one place.

    auto  an HF directory's generation_config.json (the keys vLLM takes: temperature, top_p,
          top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens), or a GGUF
          file's `general.sampling.*` metadata (llama.cpp's names); absent: no defaults
    DIR   the generation_config.json in that directory
    none  no model defaults (`vllm`, vLLM's spelling, is taken too)

The engine reads them once at start (EngineCore.generation_defaults); `LLM` and the server
(ModelInfo.generation_defaults) apply them to a request that omits a field, never over a
value the request gives.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
NO_DEFAULTS = ("none", "vllm")
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
_INT_FIELDS = ("top_k", "max_tokens")


def generation_defaults(model_path: str | Path, setting: str = "auto", gguf_reader: Any = None,
                        log: bool = True) -> dict[str, Any]:
    """SamplingParams keyword values the model recommends, e.g. {"temperature": 0.6, "top_p": 0.9}.

    model_path: the loaded .gguf file or HF directory; gguf_reader: its GGUFFile when it
    is a GGUF file (opened here if None). A bad value raises ValueError naming its source.
    """
    if not isinstance(setting, str) or not setting:
        raise ValueError(f"generation_config must be auto, none or a directory, got {setting!r}")
    if setting in NO_DEFAULTS:
        return {}
    path = Path(model_path)
    if setting != "auto":
        path = Path(setting).expanduser()
        if not (path / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(f"generation_config {setting!r} must be auto, none, or a directory holding "
                             f"{GENERATION_CONFIG_FILE}")
    if path.is_file() and path.suffix == ".gguf":
        source, values = f"{path.name} (general.sampling.*)", _from_gguf(path, gguf_reader)
    else:
        file = path / GENERATION_CONFIG_FILE
        if not file.is_file():
            return {}
        source, values = str(file), _from_json(file)
    defaults = _checked(values, source)
    if defaults and log:
        # vLLM warns here too: results differ from SamplingParams' own defaults.
        logger.warning("sampling defaults from the model's %s: %s; a request that omits one gets it "
                       "(--generation-config none: no model defaults)", source,
                       ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def _from_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return {ours: data[theirs] for theirs, ours in _HF_KEYS.items() if data.get(theirs) is not None}


def _from_gguf(path: Path, reader: Any) -> dict[str, Any]:
    if reader is None:
        from kvserve.models.gguf_loader import open_gguf

        reader = open_gguf(path)
    out = {}
    for key, ours in _GGUF_KEYS.items():
        value = reader.get(key)
        if value is not None:
            # float32 in the file: 0.6 comes back as 0.60000002384
            out[ours] = float(f"{value:.6g}") if isinstance(value, float) else value
    return out


def _checked(values: dict[str, Any], source: str) -> dict[str, Any]:
    """The values as SamplingParams takes them; each one validated by SamplingParams itself."""
    from kvserve.sampling_params import SamplingParams

    out = {}
    for name, value in values.items():
        if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
            value = int(value)
        if name == "top_k" and value == 0:  # HF and llama.cpp: 0 disables top-k
            value = -1
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as e:
            raise ValueError(f"the model's sampling defaults in {source}: {e} "
                             "(--generation-config none ignores them)") from None
        out[name] = value
    return out

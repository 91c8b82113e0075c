"""PoolingParams: what an embedding request asks of the engine (vLLM's PoolerConfig names).

An embedding request is a prompt that finishes after its prefill: no token is sampled. It rides
the same path as any request, its spec in `SamplingParams.extra_args["pooling"]` (plain values, so
it crosses msgpack and reaches every rank unchanged, like kv_transfer_params). The engine fills in
its --pooling where the spec leaves pooling_type out; the model runner reads the spec to pool the
final hidden states (after the final norm) of those requests (worker/pooler.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvserve.sampling_params import SamplingParams

POOLING_TYPES = ("LAST", "MEAN")
EXTRA_KEY = "pooling"


@dataclass(frozen=True)
class PoolingParams:
    # LAST: the last prompt token's hidden state; MEAN: the mean over every prompt token.
    # None: the engine's --pooling.
    pooling_type: str | None = None
    normalize: bool = True  # L2-normalize the pooled vector

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")

    @property
    def needs_every_position(self) -> bool:
        """MEAN reads every prompt position, so none may come from the prefix cache."""
        return self.pooling_type == "MEAN"

    def to_sampling_params(self) -> SamplingParams:
        """The request's params: nothing is sampled or detokenized, the spec in extra_args."""
        return SamplingParams(max_tokens=None, detokenize=False, extra_args={EXTRA_KEY: dataclasses.asdict(self)})


def pooling_params(params: Any) -> PoolingParams | None:
    """A request's pooling spec (its SamplingParams.extra_args["pooling"]), or None: a generation.
    Raises ValueError naming the field if the spec is malformed."""
    extra = getattr(params, "extra_args", None) or {}
    spec = extra.get(EXTRA_KEY)
    if spec is None:
        return None
    fields = {f.name for f in dataclasses.fields(PoolingParams)}
    if not isinstance(spec, dict) or not set(spec) <= fields:
        raise ValueError(f"pooling must be an object with the fields {', '.join(sorted(fields))}, got {spec!r}")
    return PoolingParams(**spec)


def with_default_pooling(params: SamplingParams, pooling_type: str) -> SamplingParams:
    """params with the pooling spec's pooling_type filled in from the engine's (--pooling);
    a generation's params unchanged."""
    spec = pooling_params(params)
    if spec is None or spec.pooling_type is not None:
        return params
    spec = dataclasses.replace(spec, pooling_type=pooling_type.upper())
    return dataclasses.replace(params, extra_args={**(params.extra_args or {}), EXTRA_KEY: dataclasses.asdict(spec)})

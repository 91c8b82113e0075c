"""kv_transfer_params: what a request says about where its K/V come from or go (vLLM's field).

Pure Python (no torch): the engine checks them on arrival; disagg/connector.py acts on them.
Where a decode engine fetches from is never a client's word: do_remote_prefill params must
carry the MAC a prefill engine of the deployment signed them with (auth.py; the router passes
them on untouched), and name one of this engine's `peers` when it has a list of them.
"""

from __future__ import annotations

from typing import Any

from kvserve.config import KVTransferConfig
from kvserve.disagg.auth import PARAMS_MAC, params_signed


def transfer_params(params: Any) -> dict[str, Any] | None:
    """A request's kv_transfer_params (its SamplingParams.extra_args), or None."""
    extra = getattr(params, "extra_args", None) or {}
    return extra.get("kv_transfer_params")


def check_transfer_params(p: Any, cfg: KVTransferConfig, n: int) -> None:
    """Raise ValueError naming the field when this engine cannot serve these kv_transfer_params."""
    if p is None:
        return
    if not isinstance(p, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {p!r}")
    if not cfg.enabled:
        raise ValueError("kv_transfer_params needs an engine started with --kv-role (prefill/decode "
                         "disaggregation); this one has none")
    if p.get("do_remote_decode"):
        if not cfg.produces:
            raise ValueError(f"kv_transfer_params.do_remote_decode needs --kv-role prefill or both; "
                             f"this engine is {cfg.kv_role}")
        if n != 1:
            raise ValueError(f"kv_transfer_params.do_remote_decode needs n=1, got n={n}")
    if p.get("do_remote_prefill"):
        if not cfg.consumes:
            raise ValueError(f"kv_transfer_params.do_remote_prefill needs --kv-role decode or both; "
                             f"this engine is {cfg.kv_role}")
        for key, kind in (("remote_host", str), ("remote_port", int), ("remote_request_id", str),
                          ("remote_num_blocks", int)):
            v = p.get(key)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ValueError(f"kv_transfer_params.{key} must be a{'n integer' if kind is int else ' string'} "
                                 f"(the prefill engine's response gives it), got {v!r}")
        secret = cfg.auth_key()
        if secret is None or not params_signed(secret, p):
            raise ValueError(f"kv_transfer_params.{PARAMS_MAC} is {'wrong' if PARAMS_MAC in p else 'missing'}: "
                             f"a decode engine takes do_remote_prefill params only as a prefill engine of its "
                             f"deployment signed them (the router passes them on); a client cannot name where "
                             f"K/V come from")
        peers = cfg.peers
        where = f"{p['remote_host']}:{p['remote_port']}"
        if peers is not None and where not in peers and p["remote_host"] not in peers:
            raise ValueError(f"kv_transfer_params.remote_host {where} is not one of this engine's prefill peers "
                             f"(kv_transfer_config.kv_connector_extra_config.peers: {', '.join(peers)})")

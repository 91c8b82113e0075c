"""The engine's CLI flags, generated from the option table (kvserve/config.py's FLAGS).

`add_engine_args` adds them to the parsers of serve / generate / chat / bench;
`EngineConfig.from_cli_args` reads them back. The spelling of each flag is `--` + its name with
dashes (vLLM's spelling); the groups below title them in --help.

A neutral module (no torch at import): kvserve/cli.py is the top floor and nothing imports it.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.config import FLAGS, Flag

# The exit code of every kvserve command given a bad flag or value (the message names it).
EXIT_BAD_INPUT = 2

GROUP_TITLES = {
    "engine": "engine",
    "parallel": "parallelism (ranks = tensor-parallel x pipeline-parallel size)",
    "tiers": "KV tiers (blocks evicted from the KV cache are kept here and loaded back on a hit)",
    "kv_events": "KV events (the blocks this engine caches, published for `kvserve router`)",
    "kv_transfer": "prefill/decode disaggregation (K/V computed by one engine, decoded by another)",
    "blend": "non-prefix KV reuse (CacheBlend): chunks of a prompt reuse their K/V wherever they appear",
    "speculative": "speculative decoding: drafted tokens verified in one forward, outputs unchanged",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every CLI flag of FLAGS to `parser`, in argument groups."""
    groups: dict[str, Any] = {}
    for f in FLAGS:
        if not f.cli:
            continue
        if f.group not in groups:
            groups[f.group] = parser.add_argument_group(GROUP_TITLES[f.group])
        groups[f.group].add_argument(f.option, *f.aliases, **argparse_kwargs(f))


def argparse_kwargs(flag: Flag) -> dict[str, Any]:
    """`parser.add_argument`'s keywords for `flag` (its spellings aside)."""
    kw: dict[str, Any] = {"dest": flag.name, "default": flag.default, "help": flag.help}
    if flag.boolean == "store_true":
        return {**kw, "action": "store_true"}
    if flag.boolean == "optional":
        return {**kw, "action": argparse.BooleanOptionalAction}
    extra = {"type": flag.type, "choices": list(flag.choices) if flag.choices else None, "metavar": flag.metavar}
    return {**kw, **{k: v for k, v in extra.items() if v is not None}}

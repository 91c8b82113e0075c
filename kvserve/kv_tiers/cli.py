"""`kvserve cache stats|clear`: inspect or empty the KV tiers of a running server, a disk
tier directory, or a Redis store.

    kvserve cache stats --url http://127.0.0.1:8000 [--api-key KEY]
    kvserve cache clear --disk /var/cache/kvserve-kv
    kvserve cache stats --remote redis://127.0.0.1:6379
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any


def add_cache_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("cache", help="inspect or empty the KV cache tiers")
    p.add_argument("action", choices=["stats", "clear"])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running `kvserve serve` (its device cache and every tier)")
    where.add_argument("--disk", metavar="PATH", help="a disk tier directory (no server needed)")
    where.add_argument("--remote", metavar="URL", help="a Redis KV store, e.g. redis://127.0.0.1:6379")
    p.add_argument("--api-key", default=None, help="for a server started with --api-key")
    p.set_defaults(func=cmd_cache)


def cmd_cache(args: argparse.Namespace) -> int:
    if args.url is not None:
        result = _server(args.url, args.action, args.api_key)
    else:
        result = _local(args)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _server(url: str, action: str, api_key: str | None) -> dict[str, Any]:
    path = "/kv_cache/stats" if action == "stats" else "/kv_cache/clear"
    req = urllib.request.Request(url.rstrip("/").removesuffix("/v1") + path,
                                 method="GET" if action == "stats" else "POST",
                                 headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ValueError(f"--url {url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"--url {url}: cannot reach the server ({e})") from None


def _local(args: argparse.Namespace) -> dict[str, Any]:
    from pathlib import Path

    if args.disk is not None:
        if not Path(args.disk).is_dir():
            raise ValueError(f"--disk {args.disk!r} is not a directory")
        from kvserve.kv_tiers.disk import DiskTier

        tier = DiskTier(args.disk, capacity_bytes=1 << 62)  # capacity 'unbounded': inspect, never evict
    else:
        from kvserve.kv_tiers.remote import RemoteTier

        tier = RemoteTier(args.remote)
    try:
        if args.action == "clear":
            return {"cleared": {tier.name: tier.clear()}}
        stats = tier.stats()
        if not stats.get("available", True):
            raise ValueError(f"--remote {args.remote}: the store is not reachable")
        return {tier.name: stats}
    finally:
        tier.close()

"""The KVTier contract shared by the host-RAM, disk and remote tiers.

A tier is a key -> blob store. Keys are opaque bytes (32-byte sha256 digests in
practice); blobs are opaque bytes, normally made by `codec.encode_entry`. The
tier neither inspects nor trusts blob contents: checking them is the reader's
job (see `get_verified`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from kvserve.kv_tiers.codec import CorruptEntryError, decode_entry

logger = logging.getLogger(__name__)

StatValue = int | float | bool | str


@dataclass
class Evicted:
    """An entry a tier dropped to make room, handed to the caller so it can be
    demoted to a slower tier. `hits` counts `get` hits since it was put."""

    key: bytes
    blob: bytes
    hits: int


class KVTier(ABC):
    """A bounded (or externally bounded) key -> blob store.

    Contract for every implementation:
      * Thread-safe: the manager calls from the engine step thread and from a
        background I/O thread at the same time.
      * Never raises on I/O trouble (disk full, permissions, server down): the
        tier logs through its module logger and reports failure through the
        return value (`None`, `False`, all-False). Programming errors (wrong
        argument types) may still raise.
      * `get` hits refresh LRU recency; `contains`/`contains_many` do not, so a
        lookahead probe does not keep cold entries alive.
    """

    name: ClassVar[str]

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The blob stored under `key`, or None if absent or the tier is unavailable."""

    @abstractmethod
    def put(self, key: bytes, blob: bytes) -> bool:
        """Store `blob` under `key`, replacing any existing entry.

        Returns False when not stored: larger than the capacity, tier
        unavailable, disk full. A refused replacement leaves the old entry.
        """

    @abstractmethod
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Membership of each key, in order, in one round trip; all False when unavailable."""

    def contains(self, key: bytes) -> bool:
        """Membership of one key; see `contains_many`."""
        return self.contains_many([key])[0]

    @abstractmethod
    def delete(self, key: bytes) -> None:
        """Remove `key` if present (absent is not an error)."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every entry this tier owns; returns how many were removed."""

    @abstractmethod
    def stats(self) -> dict[str, StatValue]:
        """At least `entries`, `bytes_used`, `capacity_bytes` (0: unbounded or
        bounded elsewhere) and `available`; tiers may add their own fields."""

    @abstractmethod
    def close(self) -> None:
        """Release resources. Afterwards the tier behaves as unavailable."""

    def get_verified(self, key: bytes) -> tuple[dict[str, Any], bytes] | None:
        """`get` + `decode_entry`: `(meta, data)`, or None when absent.

        A blob that fails the codec check (corrupt, truncated, foreign) is
        deleted so that it is not read again, and reported with a warning.
        """
        blob = self.get(key)
        if blob is None:
            return None
        try:
            return decode_entry(key, blob)
        except CorruptEntryError as e:
            logger.warning("%s KV tier: dropping corrupt entry %s: %s", self.name, key.hex(), e)
            self.delete(key)
            return None

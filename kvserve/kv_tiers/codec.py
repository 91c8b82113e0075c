"""The self-checking entry format every KV tier stores.

Layout (little-endian)::

    b"KVT1" | u16 key_len | key | u32 meta_len | meta (msgpack) | u64 data_len | data | u32 crc32

The crc32 covers every byte before it. The key is embedded so that a blob read
back under some key can be proven to belong to that key: a disk file renamed by
hand, a Redis value written by a replica with another key scheme, or a hash
collision in a shorter prefix all surface as a "foreign entry" instead of
silently wrong KV.

`decode_entry` is total over arbitrary bytes: it returns or raises
`CorruptEntryError`, nothing else, so tiers can hand it whatever the storage gave
back. Meta round-trips through msgpack, so tuples come back as lists.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack

MAGIC = b"KVT1"
_KEY_LEN = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MAX_KEY_LEN = 0xFFFF
# The smallest possible entry: magic, empty key, empty meta, empty data, crc.
MIN_ENTRY_LEN = len(MAGIC) + _KEY_LEN.size + _U32.size + _U64.size + _U32.size

# Any C-contiguous buffer works (a numpy array of KV included); these are the common ones.
Buffer = bytes | bytearray | memoryview


class CorruptEntryError(ValueError):
    """A blob is not a valid entry for the requested key; the message says why."""


def encode_entry(key: bytes, meta: dict[str, Any], data: Buffer) -> bytes:
    """Serialize one entry. `data` (any contiguous buffer) is copied exactly once, into the result.

    Raises ValueError if the key is longer than 65535 bytes, and TypeError if
    `meta` holds something msgpack cannot serialize.
    """
    if len(key) > _MAX_KEY_LEN:
        raise ValueError(f"key too long: {len(key)} bytes > {_MAX_KEY_LEN}")
    meta_b = msgpack.packb(meta, use_bin_type=True)
    data_len = memoryview(data).nbytes
    head = b"".join((MAGIC, _KEY_LEN.pack(len(key)), key, _U32.pack(len(meta_b)), meta_b, _U64.pack(data_len)))
    # Chain the crc over head then data so the payload is never concatenated twice.
    crc = zlib.crc32(data, zlib.crc32(head))
    return b"".join((head, data, _U32.pack(crc)))


def decode_entry(key: bytes, blob: Buffer) -> tuple[dict[str, Any], bytes]:
    """Check `blob` and return `(meta, data)`.

    Raises CorruptEntryError (and nothing else) on: bad magic, truncated blob,
    length mismatch (trailing bytes), checksum mismatch, undecodable meta, or a
    foreign entry (the embedded key differs from `key`). Structure is checked
    before the checksum so a truncated blob says "truncated".
    """
    mv = memoryview(blob).cast("B")
    n = mv.nbytes
    if n < len(MAGIC):
        what = "truncated" if MAGIC.startswith(bytes(mv)) else "bad magic"
        raise CorruptEntryError(f"{what}: entry of {n} bytes is shorter than the magic")
    if mv[:4] != MAGIC:
        raise CorruptEntryError(f"bad magic: {bytes(mv[:4])!r}, expected {MAGIC!r}")
    off = len(MAGIC)
    key_len = _read(_KEY_LEN, mv, off, "key length")
    off += _KEY_LEN.size + key_len
    meta_len = _read(_U32, mv, off, "meta length")
    meta_off = off + _U32.size
    off = meta_off + meta_len
    data_len = _read(_U64, mv, off, "data length")
    data_off = off + _U64.size
    expected = data_off + data_len + _U32.size
    if n < expected:
        raise CorruptEntryError(f"truncated: header promises {expected} bytes, got {n}")
    if n > expected:
        raise CorruptEntryError(f"length mismatch: header promises {expected} bytes, got {n}")
    (stored_crc,) = _U32.unpack_from(mv, n - _U32.size)
    actual_crc = zlib.crc32(mv[: n - _U32.size])
    if stored_crc != actual_crc:
        raise CorruptEntryError(f"checksum mismatch: stored {stored_crc:#010x}, computed {actual_crc:#010x}")
    embedded_key = mv[len(MAGIC) + _KEY_LEN.size : len(MAGIC) + _KEY_LEN.size + key_len]
    if embedded_key != key:
        raise CorruptEntryError(f"foreign entry: embedded key {bytes(embedded_key).hex()} != requested {key.hex()}")
    meta = _unpack_meta(mv[meta_off : meta_off + meta_len])
    return meta, bytes(mv[data_off : data_off + data_len])


def _read(fmt: struct.Struct, mv: memoryview, off: int, what: str) -> int:
    """Read one length field, or raise "truncated" if the blob ends first."""
    if off + fmt.size > mv.nbytes:
        raise CorruptEntryError(f"truncated: blob of {mv.nbytes} bytes ends before the {what} at offset {off}")
    return fmt.unpack_from(mv, off)[0]


def _unpack_meta(raw: memoryview) -> dict[str, Any]:
    # Reached only with a valid checksum, i.e. a writer that did not use
    # encode_entry; msgpack raises a zoo of exception types, so catch broadly.
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - the contract is "only CorruptEntryError"
        raise CorruptEntryError(f"bad meta: not valid msgpack ({e})") from None
    if not isinstance(meta, dict):
        raise CorruptEntryError(f"bad meta: expected a map, got {type(meta).__name__}")
    return meta

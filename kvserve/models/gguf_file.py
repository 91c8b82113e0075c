"""A GGUF file's metadata and tensors, opened in milliseconds.

gguf's GGUFReader builds a numpy view for every metadata value, one string at a time: 5.2 s for
the default model's 49k-token vocabulary and merges on a Zen 3 core, paid by every process that
opens the file (the engine and the server each do). This reads the same layout (ggml's
docs/gguf.md, versions 2 and 3) with struct over an mmap: scalars and numeric arrays at once,
string arrays skipped and decoded on first use. Tensors are numpy views of the mapping, shaped as
GGUFReader shapes them (rows first; quantized types as bytes per row), so gguf's dequantize
functions take them. gguf's own constants (value and tensor types, block sizes) are used.

Everything in the file is untrusted: lengths and offsets are checked against the file's size,
and anything malformed raises ValueError.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_MAX_DIMS = 4  # GGML_MAX_DIMS
_SCALAR = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
           GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_SCALAR_SIZE = {t: struct.calcsize(f) for t, f in _SCALAR.items()}
_ARRAY_DTYPE = {t: np.dtype(f) for t, f in _SCALAR.items()}
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64 dims in GGUF order (innermost first), as GGUFReader gives them
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # read-only view: rows first; quantized types as uint8 [..., bytes per row]


class _Strings(NamedTuple):
    """A string array not decoded yet: where its first length sits, and how many strings."""

    offset: int
    count: int


class GGUFFile:
    """`get(key)` a metadata value (str, int, float, bool, or a list for arrays); `tensors` in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"{size} bytes: too short for a GGUF header")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._size = size
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", self._buf, 0)
        if magic != _MAGIC:
            raise ValueError(f"not a GGUF file (magic {magic!r})")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        # Each entry takes at least 12 bytes (key length and type; a tensor: name length, dims, type,
        # offset): counts that cannot fit are refused before any loop runs.
        if n_kv * 12 + n_tensors * 24 > size:
            raise ValueError(f"header claims {n_kv} metadata entries and {n_tensors} tensors in {size} bytes")
        self._off = 24
        self._meta: dict[str, Any] = {}
        self._types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self._meta:
                raise ValueError(f"metadata key {key!r} appears twice")
            self._meta[key] = self._value(key, self._u32())
        infos = [self._tensor_info() for _ in range(n_tensors)]
        if len({info[0] for info in infos}) != len(infos):
            raise ValueError("a tensor name appears twice")
        alignment = self._meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment % 8:
            raise ValueError(f"general.alignment {alignment!r} is not a positive multiple of 8")
        start = -(-self._off // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    # -- metadata ------------------------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        value = self._meta.get(key, default)
        if isinstance(value, _Strings):
            value = self._meta[key] = self._decode_strings(value)
        return value

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    def keys(self) -> list[str]:
        return list(self._meta)

    def value_type(self, key: str) -> tuple[GGUFValueType, GGUFValueType | None]:
        """(the value's GGUF type, its items' type for an array, else None): to copy a value exactly."""
        return self._types[key]

    def array_len(self, key: str) -> int | None:
        """The length of an array value without decoding it (None: absent or not an array)."""
        value = self._meta.get(key)
        if isinstance(value, _Strings):
            return value.count
        return len(value) if isinstance(value, list) else None

    # -- parsing -------------------------------------------------------------------------------------------------

    def _take(self, n: int) -> int:
        """Advance past n bytes; the offset they start at."""
        off = self._off
        if n < 0 or off + n > self._size:
            raise ValueError(f"truncated: {n} bytes wanted at offset {off} of {self._size}")
        self._off = off + n
        return off

    def _u32(self) -> int:
        return struct.unpack_from("<I", self._buf, self._take(4))[0]

    def _u64(self) -> int:
        return struct.unpack_from("<Q", self._buf, self._take(8))[0]

    def _string(self) -> str:
        n = self._u64()
        off = self._take(n)
        try:
            return self._buf[off:off + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"string at offset {off} is not UTF-8: {e}") from e

    def _value(self, key: str, vtype: int) -> Any:
        if vtype in _SCALAR or vtype == GGUFValueType.STRING:
            self._types[key] = (GGUFValueType(vtype), None)
            if vtype == GGUFValueType.STRING:
                return self._string()
            return struct.unpack_from(_SCALAR[vtype], self._buf, self._take(_SCALAR_SIZE[vtype]))[0]
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"metadata {key!r} has unknown value type {vtype}")
        etype, count = self._u32(), self._u64()
        if etype not in _SCALAR and etype != GGUFValueType.STRING:
            raise ValueError(f"metadata {key!r} is an array of unsupported item type {etype}")
        self._types[key] = (GGUFValueType.ARRAY, GGUFValueType(etype))
        if etype in _ARRAY_DTYPE:
            dtype = _ARRAY_DTYPE[etype]
            return np.frombuffer(self._buf, dtype, count, self._take(count * dtype.itemsize)).tolist()
        if count * 8 > self._size:
            raise ValueError(f"metadata {key!r}: {count} strings cannot fit in the file")
        strings = _Strings(self._off, count)
        buf, off, size = self._buf, self._off, self._size
        for _ in range(count):  # skip them: each is a u64 length and its bytes
            if off + 8 > size:
                raise ValueError(f"metadata {key!r}: truncated string array")
            off += 8 + struct.unpack_from("<Q", buf, off)[0]
        self._take(off - self._off)
        return strings

    def _decode_strings(self, s: _Strings) -> list[str]:
        out, buf, off = [], self._buf, s.offset
        for _ in range(s.count):
            n = struct.unpack_from("<Q", buf, off)[0]
            out.append(buf[off + 8:off + 8 + n].decode("utf-8", errors="replace"))
            off += 8 + n
        return out

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        n_dims = self._u32()
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = [self._u64() for _ in range(n_dims)]
        return name, dims, self._u32(), self._u64()

    def _tensor(self, start: int, name: str, dims: list[int], raw_type: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise ValueError(f"tensor {name!r} has type {qtype.name} without a known block size")
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims, dtype=object))
        rows_first = tuple(reversed(dims))
        if n_elements and dims[0] % block:
            raise ValueError(f"tensor {name!r}: rows of {dims[0]} values are not whole {qtype.name} blocks of {block}")
        n_bytes = n_elements // block * type_size
        data_offset = start + offset
        if data_offset + n_bytes > self._size:
            raise ValueError(f"tensor {name!r} ({n_bytes} bytes at {data_offset}) runs past the end of the file")
        if qtype in _PLAIN:
            data = np.frombuffer(self._buf, _PLAIN[qtype], n_elements, data_offset).reshape(rows_first)
        else:
            shape = (*rows_first[:-1], dims[0] // block * type_size)
            data = np.frombuffer(self._buf, np.uint8, n_bytes, data_offset).reshape(shape)
        return GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_elements, n_bytes, data_offset, data)

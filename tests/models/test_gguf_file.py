"""kvserve's GGUF reader (models/gguf_file.py) against gguf's GGUFReader: the same metadata values
and the same tensor views, on the default model and on a file with every value type; anything
malformed is a ValueError."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from kvserve.models.gguf_file import GGUFFile
from kvserve.models.loader import default_model_path

Q = gguf.GGMLQuantizationType


def _same_as_gguf(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own header entries
    assert ours.keys() == keys
    for key in keys:
        field = theirs.fields[key]
        assert ours.get(key) == field.contents(), key
        assert ours.value_type(key) == (field.types[0], field.types[-1] if len(field.types) > 1 else None), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist() and a.shape.dtype == b.shape.dtype
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, np.asarray(b.data)), a.name
        assert not a.data.flags.writeable
    return ours


def test_default_model_reads_as_gguf_reads_it():
    path = default_model_path()
    ours = _same_as_gguf(path)
    assert ours.array_len("tokenizer.ggml.tokens") == 49152
    assert ours.get("tokenizer.ggml.tokens")[:2] == ["<|endoftext|>", "<|im_start|>"]


def _write_every_type(path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.6)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        w.add_tensor(qtype.name, gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_and_tensor_type(tmp_path):
    path = tmp_path / "types.gguf"
    _write_every_type(path)
    ours = _same_as_gguf(path)
    assert ours.get("t.strs") == ["a", "", "ünï"] and ours.array_len("t.strs") == 3
    assert ours.get("t.u64") == 2**63 + 5 and ours.get("t.bool") is True
    assert ours.get("absent", 7) == 7 and ours.array_len("t.str") is None
    q4 = next(t for t in ours.tensors if t.name == "Q4_0")
    assert q4.data.shape == (4, 64 // 32 * 18)
    np.testing.assert_allclose(gguf.quants.dequantize(q4.data, Q.Q4_0).shape, (4, 64))


def test_malformed_files_raise_value_error(tmp_path):
    path = tmp_path / "types.gguf"
    _write_every_type(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    # Cut anywhere in the header, the metadata, the tensor infos or the data.
    for n in [0, 10, 23, 24, 40, 100, 300, len(data) // 2, len(data) - 1]:
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError):
            GGUFFile(cut)
    bad = tmp_path / "bad.gguf"
    cases = {
        "magic": b"GGUX" + data[4:],
        "version": data[:4] + struct.pack("<I", 9) + data[8:],
        "tensor count": data[:8] + struct.pack("<Q", 2**40) + data[16:],
        "kv count": data[:16] + struct.pack("<Q", 2**40) + data[24:],
        "key length": data[:24] + struct.pack("<Q", 2**62) + data[32:],
    }
    for what, blob in cases.items():
        bad.write_bytes(blob)
        with pytest.raises(ValueError):
            GGUFFile(bad)

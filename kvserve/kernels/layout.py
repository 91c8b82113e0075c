"""ctypes Structures checked against the C structs they mirror.

A library that takes structs by pointer exports a layout table (c/layout.h: KV_LAYOUT_TABLE): the
sizeof of each struct and the sizeof / offsetof of each field. Its wrapper calls `check` on each
of its Structures when the library loads, so a field added, dropped or reordered on one side only
raises a RuntimeError naming the field instead of passing the C code the wrong bytes.
"""

from __future__ import annotations

import ctypes


class _Entry(ctypes.Structure):  # c/layout.h's KvLayout
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("size", ctypes.c_int64),
                ("offset", ctypes.c_int64)]


Layout = dict[str, dict[str | None, tuple[int, int]]]  # struct -> field (None: the struct) -> (size, offset)


def c_layout(lib: ctypes.CDLL, fn_name: str) -> Layout:
    """The layout table `lib` exports as `fn_name` (a KV_LAYOUT_TABLE)."""
    fn = getattr(lib, fn_name)
    fn.restype, fn.argtypes = None, [ctypes.POINTER(ctypes.POINTER(_Entry)), ctypes.POINTER(ctypes.c_int64)]
    table, n = ctypes.POINTER(_Entry)(), ctypes.c_int64()
    fn(ctypes.byref(table), ctypes.byref(n))
    out: Layout = {}
    for i in range(n.value):
        e = table[i]
        out.setdefault(e.type.decode(), {})[None if e.field is None else e.field.decode()] = (e.size, e.offset)
    return out


def check(structure: type[ctypes.Structure], layout: Layout, c_name: str | None = None) -> None:
    """Raise RuntimeError unless `structure` has the C struct's size and exactly its fields, each of
    the C field's size at its offset. c_name: the C struct's name (default the Structure's)."""
    name = c_name or structure.__name__
    if name not in layout:
        raise RuntimeError(f"ctypes struct {structure.__name__}: the C library describes no struct {name} "
                           f"(it has {', '.join(sorted(layout))})")
    want = layout[name]
    problems = []
    size = ctypes.sizeof(structure)
    if size != want[None][0]:
        problems.append(f"sizeof is {size} in ctypes, {want[None][0]} in C")
    py_fields = [f[0] for f in structure._fields_]
    c_fields = sorted((f for f in want if f is not None), key=lambda f: want[f][1])
    problems += [f"field {f} is not in the C struct" for f in py_fields if f not in want]
    problems += [f"field {f} of the C struct is missing" for f in c_fields if f not in py_fields]
    for f in py_fields:
        if f in want:
            d = getattr(structure, f)
            if (d.size, d.offset) != want[f]:
                problems.append(f"field {f} is {d.size} bytes at offset {d.offset} in ctypes, "
                                f"{want[f][0]} bytes at offset {want[f][1]} in C")
    if problems:
        raise RuntimeError(f"ctypes struct {structure.__name__} does not match the C struct {name} "
                           f"(C field order: {', '.join(c_fields)}): " + "; ".join(problems))

"""Build a C source of c/ with the system compiler once, cache the shared library, load it with ctypes.

The sources are the package's own files (c/*.c, c/*.h, shipped as package data); each library is
one .c file, which may `#include "..."` others of c/ (compiled with -I c/). No torch headers: a
kernel library builds in about a second. The cache lives under `$KVSERVE_CACHE_DIR/kernels`
(default `~/.cache/kvserve/kernels`), keyed by the text of every file compiled in, the compiler,
its flags and the ISA level, so a changed source or CPU level never loads a stale build.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvserve.kernels import cpu

logger = logging.getLogger(__name__)

C_DIR = Path(__file__).parent / "c"  # the kernels' sources and headers
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

# fast-math lets expf and the reductions vectorize; -inf still has to mean -inf.
COMPILE_FLAGS = ("-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC")
# Linked in a separate step without -ffast-math: a -ffast-math link adds crtfastmath.o,
# whose constructor turns on flush-to-zero for the whole process that loads the library.
LINK_FLAGS = ("-shared", "-fopenmp")


def cache_dir() -> Path:
    """Where kvserve keeps what it builds or measures ($KVSERVE_CACHE_DIR or ~/.cache/kvserve)."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def compiler() -> str | None:
    """The C compiler ($CC, else cc, else gcc), or None."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def sources(file: str) -> list[Path]:
    """c/`file` and every file of c/ it includes (`#include "..."`, recursively), each once, in the
    order first reached: what a build of it compiles in."""
    seen: list[Path] = []

    def visit(path: Path) -> None:
        if path in seen:
            return
        if not path.is_file():
            raise OSError(f"kernel source {path} is missing")
        seen.append(path)
        for inc in _INCLUDE.findall(path.read_text()):
            visit(C_DIR / inc)

    visit(C_DIR / file)
    return seen


def source_digest(file: str) -> str:
    """A digest of the text of every file a build of c/`file` compiles in (sources): any edit changes it."""
    h = hashlib.sha256()
    for path in sources(file):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build(name: str, file: str, flags: tuple[str, ...] | list[str]) -> ctypes.CDLL:
    """Compile c/`file` with COMPILE_FLAGS + flags and `-I c/` (once per distinct input: the key covers
    the text of every file it includes), load and return it.

    Raises OSError / subprocess.SubprocessError when there is no compiler or the build fails.
    """
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (set CC, or install gcc)")
    cflags = [*COMPILE_FLAGS, *flags]
    key = hashlib.sha256("\0".join([source_digest(file), cc, *cflags, *LINK_FLAGS]).encode()).hexdigest()[:16]
    lib_path = cache_dir() / "kernels" / f"{name}_{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            obj, tmp_lib = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
            try:
                subprocess.run([cc, *cflags, "-I", str(C_DIR), "-c", str(C_DIR / file), "-o", str(obj)], check=True,
                               capture_output=True, timeout=180)
                subprocess.run([cc, *LINK_FLAGS, str(obj), "-o", str(tmp_lib), "-lm"], check=True,
                               capture_output=True, timeout=120)
            except subprocess.CalledProcessError as e:
                raise subprocess.SubprocessError(f"{name}: {' '.join(e.cmd[:2])} failed: "
                                                 f"{e.stderr.decode(errors='replace')[-2000:]}") from None
            os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see half a file
    return ctypes.CDLL(str(lib_path))


_loaded: dict[str, ctypes.CDLL | None] = {}


def load_library(name: str, file: str, signatures: dict[str, list], extra_flags: tuple[str, ...] = ()
                 ) -> ctypes.CDLL | None:
    """c/`file` built for this CPU's ISA level (cpu.isa_level()) with its functions' argument types
    set (each returns void), once per process; None without a compiler, when the build fails, or
    with KVSERVE_NO_C_KERNEL=1: callers then use torch ops."""
    if name not in _loaded:
        lib = None
        if os.environ.get("KVSERVE_NO_C_KERNEL") != "1":
            try:
                lib = build(name, file, (*cpu.compile_flags(cpu.isa_level()), "-mtune=native", *extra_flags))
                for fn_name, argtypes in signatures.items():
                    fn = getattr(lib, fn_name)
                    fn.restype, fn.argtypes = None, argtypes
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("C kernel %s unavailable, using torch ops: %s", name, e)
                lib = None
        _loaded[name] = lib
    return _loaded[name]

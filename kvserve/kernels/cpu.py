"""What this CPU can do: its model name, its instruction-set flags, and the ISA level C kernels use.

The level is the best the CPU runs; `KVSERVE_CPU_ISA=avx2` (or any lower level) makes the C kernels
imitate a smaller CPU, as ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA do for torch's own kernels.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache

# From best to plainest; each level's flags (/proc/cpuinfo names) and the compiler options it builds with.
LEVELS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512_vnni": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}),
                    ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                     "-mavx512vnni")),
    "avx512": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}),
               ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")),
    "avx_vnni": (frozenset({"avx_vnni", "avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    "generic": (frozenset(), ()),
}
# Flags worth printing in `kvserve env` and in benchmark notes.
REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
            "amx_bf16", "amx_int8", "amx_tile", "neon", "asimd", "sve")


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and model in ("", platform.machine(),
                                                                           platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    """The CPU's model name ('AMD EPYC', 'Intel(R) Xeon(R) ...'), or the machine type."""
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it cannot be read)."""
    return _cpuinfo()[1]


def reported_flags() -> list[str]:
    """The flags among REPORTED that this CPU has, in REPORTED's order."""
    flags = cpu_flags()
    return [f for f in REPORTED if f in flags]


def native_level() -> str:
    """The best level of LEVELS this CPU runs (x86 only; other machines get 'generic')."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    flags = cpu_flags()
    return next(name for name, (needs, _) in LEVELS.items() if needs <= flags)


def isa_level() -> str:
    """The level C kernels are built for: native_level(), or KVSERVE_CPU_ISA if it names a level the
    CPU can run (one it cannot is refused: it would crash with SIGILL)."""
    native = native_level()
    want = os.environ.get("KVSERVE_CPU_ISA", "").strip().lower()
    if not want:
        return native
    if want not in LEVELS:
        raise ValueError(f"KVSERVE_CPU_ISA={want!r} is not one of {', '.join(LEVELS)}")
    if want != "generic" and (native == "generic" or not LEVELS[want][0] <= cpu_flags()):
        raise ValueError(f"KVSERVE_CPU_ISA={want!r}: this CPU cannot run it (its levels: "
                         f"{', '.join(runnable_levels())})")
    return want


def runnable_levels() -> list[str]:
    """Every level this CPU runs, best first (the levels are not a chain: an AVX-512 CPU may lack
    AVX-VNNI)."""
    if native_level() == "generic":
        return ["generic"]
    flags = cpu_flags()
    return [name for name, (needs, _) in LEVELS.items() if needs <= flags]


def compile_flags(level: str) -> tuple[str, ...]:
    """Compiler options for a level."""
    return LEVELS[level][1]

"""`kvserve env`: what a bug report needs about this machine, in one paste.

Speed and even results here depend on the machine (DESIGN.md, "CPUs differ"): the CPU's
instruction sets, torch's threads, whether the C kernels built, and what the start-up
measurements chose and cached. `collect()` gathers all of it as plain data (`--json`),
`format()` lays it out for a person. A broken part never stops the report: its error is
shown where its value would be.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from kvserve import threads

# Used when kvserve runs from a checkout without installed metadata.
FALLBACK_DEPS = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "fastapi", "uvicorn", "pydantic",
                 "pyzmq", "redis", "ray", "triton")
# Variables that change threads, instruction sets or kernels, besides every KVSERVE_*.
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS", "CC")
# (name shown, module, function): each returns the loaded library or None.
C_KERNELS = (("paged_decode", "kvserve.kernels.paged_attention", "load_kernel"),
             ("qmatmul", "kvserve.kernels.qmatmul", "load"),
             ("fused ops", "kvserve.kernels.ops", "load"),
             ("decode stack", "kvserve.kernels.decode_stack", "load"))
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)  # reports get pasted in public


def _attempt(fn: Callable[[], Any]) -> Any:
    """fn(), or 'error: ...' in its place."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any failure is part of the report
        return f"error: {type(e).__name__}: {e}"


def _dependencies() -> list[str]:
    """kvserve's requirements and its `ray` and `triton` extras, as the installed metadata lists them."""
    try:
        reqs = metadata.requires("kvserve") or []
    except metadata.PackageNotFoundError:
        return list(FALLBACK_DEPS)
    names: list[str] = []
    for req in reqs:
        spec, _, marker = req.partition(";")
        name = re.match(r"[A-Za-z0-9_.\-]+", spec.strip())
        if name and (not marker or '"ray"' in marker or '"triton"' in marker) and name.group(0) not in names:
            names.append(name.group(0))
    return names


def _versions() -> dict[str, str]:
    out = {"kvserve": _attempt(lambda: metadata.version("kvserve")), "python": platform.python_version(),
           "platform": platform.platform()}
    for name in _dependencies():
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass  # an optional one (ray, triton) that is not installed
    return out


def _cpu() -> dict[str, Any]:
    from kvserve.kernels import cpu

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": cpu.cpu_model(), "machine": platform.machine(), "flags": cpu.reported_flags(),
            "native_level": cpu.native_level(), "isa_level": _attempt(cpu.isa_level),
            "cpu_count": os.cpu_count(), "usable_cores": usable}


def _torch() -> dict[str, Any]:
    import torch

    info = torch.__config__.parallel_info()
    backend = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                    if line.startswith("ATen parallel backend")), None)
    return {"version": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "parallel_backend": backend, "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "wait_policy": threads.wait_policy(), "adaptive": _adaptive(),
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}


def _adaptive() -> str:
    if os.environ.get(threads.ADAPTIVE_ENV, "1") == "0":
        return f"off ({threads.ADAPTIVE_ENV}=0)"
    return "on: fewer threads while steps run 2x slower than quiet ones (--cpu-threads N pins the count)"


def _first_line(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    return (out.stdout or out.stderr).strip().splitlines()[0]


def _c_kernels() -> dict[str, Any]:
    """The compiler, and whether each library builds and loads here (building it if it is not cached)."""
    from kvserve.kernels import build

    cc = build.compiler()
    out: dict[str, Any] = {"compiler": cc, "compiler_version": _attempt(lambda: _first_line([cc, "--version"]))
                           if cc else None}
    for name, module, fn in C_KERNELS:
        out[name] = _attempt(lambda m=module, f=fn: getattr(importlib.import_module(m), f)() is not None)
    out["amx"] = _attempt(lambda: importlib.import_module("kvserve.kernels.qmatmul").amx_ready())
    return out


def _tuning_file(path: Path) -> dict[str, Any]:
    """One cached decision of kvserve/kernels/tuning.py: what it chooses, the medians, and its
    evidence (the spread of its rounds, when it was made, why the next start re-measures it)."""
    from kvserve.kernels import cpu, evidence, tuning

    kind = path.name.split("_", 1)[0]
    entry: dict[str, Any] = {"file": path.name, "kind": kind}
    try:
        data = json.loads(path.read_text())
        times = data["times"]
        if kind == "dtype":  # {dtype: {rows: median seconds}} at a decode- and a prefill-sized batch
            rows = (str(tuning.DECODE_ROWS), str(tuning.PREFILL_ROWS))
            entry["seconds"] = {name: {r: float(t[r]) for r in rows} for name, t in times.items()}
            entry["chosen"] = tuning.pick_dtype(times, cpu.cpu_flags())
        elif kind == "attention":  # {path: {"QxL": median seconds}}: prefill attention's two paths
            entry["attention_seconds"] = {name: {c: float(v) for c, v in t.items()} for name, t in times.items()}
            entry["chosen"] = tuning.pick_attention(times)
        elif kind in ("linears", "kquant"):  # K-quant linears: one kernel, "int16" in the modes' place
            # The file does not say how many linears share a shape: count each once.
            chosen = tuning.choose(times, {shape: 1 for shape in times}, flags=cpu.cpu_flags())
            entry["activations"] = chosen["activations"]
            entry["dense_from"] = {s: None if v == tuning.NEVER else v for s, v in chosen["dense_from"].items()}
            entry["dense_dtype"] = chosen["dense_dtype"]
            entry["int8_from"] = {s: None if v == tuning.NEVER else v for s, v in chosen["int8_from"].items()}
        entry["noise"], entry["made"] = evidence.entry_noise(data), data.get("made")
        entry["recheck"] = evidence.staleness(data)  # None: the next start only spot-checks it
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        entry["error"] = f"{type(e).__name__}: {e}"
    return entry


def _bandwidth() -> dict[str, Any] | None:
    """Memory read bandwidth with torch's threads (kvserve/kernels/bandwidth.py; measured once, cached)."""
    from kvserve.kernels import bandwidth

    return bandwidth.read_bandwidth()


def _bandwidth_line(b: Any) -> str:
    if b is None or isinstance(b, str):
        return b or "not measured (no C kernels)"
    how = "cached" if b["cached"] else "measured now"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(b["made"]))
    return f"{b['gb_s']:.1f} GB/s ({b['threads']} threads, best of {len(b['seconds'])} reads of " \
           f"{b['bytes'] >> 20} MiB; {how}, made {when})"


def _cache() -> dict[str, Any]:
    from kvserve.kernels import build

    root = build.cache_dir()
    return {"dir": str(root), "kernels": sorted(p.name for p in (root / "kernels").glob("*.so")),
            "tuning": [_tuning_file(p) for p in sorted((root / "tuning").glob("*.json"))]}


def _dtype_auto() -> dict[str, Any]:
    """What `--dtype auto` picks on this CPU for the default model (measured now if not cached)."""
    import torch

    from kvserve.models.loader import open_checkpoint, resolve_dtype, runs_float32_kernels
    from kvserve.kernels import tuning

    ckpt = open_checkpoint(None)
    config = ckpt.config
    kernels = runs_float32_kernels(ckpt, None)
    dtype = resolve_dtype("auto", "cpu", config, kernels)
    return {"dtype": str(dtype).removeprefix("torch."), "hidden": getattr(config, "hidden_size", None),
            "intermediate": getattr(config, "intermediate_size", None), "threads": torch.get_num_threads(),
            "float32_kernels": kernels, "measured": tuning.enabled() and not kernels}


def _env_vars() -> dict[str, str]:
    return {k: "(set, hidden)" if _SECRET.search(k) else v for k, v in sorted(os.environ.items())
            if k.startswith("KVSERVE_") or k in ENV_VARS}


def collect() -> dict[str, Any]:
    """Everything `kvserve env` reports, as JSON-ready data."""
    from kvserve.models.loader import default_model_path

    info = {"versions": _versions(), "cpu": _attempt(_cpu), "torch": _attempt(_torch),
            "c_kernels": _attempt(_c_kernels), "default_model": _attempt(default_model_path),
            "dtype_auto": _attempt(_dtype_auto), "memory_bandwidth": _attempt(_bandwidth)}
    # Listed last: building the kernels and choosing the dtype above may have added files.
    return {**info, "cache": _attempt(_cache), "env": _env_vars()}


def _loads(value: Any) -> str:
    return {True: "loads", False: "not loaded (torch ops instead)"}.get(value, str(value))


def _tuning_line(entry: dict[str, Any]) -> str:
    from kvserve.kernels.tuning import DECODE_ROWS, PREFILL_ROWS

    if "error" in entry:
        return f"error: {entry['error']}"
    if "seconds" in entry:
        line = f"{entry['chosen']} chosen; " + "; ".join(
            f"{name} {t[str(DECODE_ROWS)] * 1e6:.0f} us at {DECODE_ROWS} row, {t[str(PREFILL_ROWS)] * 1e3:.2f} ms at "
            f"{PREFILL_ROWS}" for name, t in entry["seconds"].items())
    elif "attention_seconds" in entry:
        line = f"prefill attention: {entry['chosen']} chosen; " + "; ".join(
            f"{name} " + ", ".join(f"{t * 1e3:.2f} ms at {case}" for case, t in cases.items())
            for name, cases in entry["attention_seconds"].items())
    elif "dense_from" in entry:
        dd, i8 = entry["dense_dtype"], entry.get("int8_from", {})
        dense = ", ".join(f"{s} " + (f"int8 from {i8[s]}, dense " if i8.get(s) is not None else "")
                          + f"{'never' if v is None else v}" + (f" in {dd[s]}" if dd.get(s) and v is not None else "")
                          for s, v in entry["dense_from"].items())
        what = "K-quant kernel" if entry["kind"] == "kquant" else \
            f"{entry['activations']} activations (each shape counted once)"
        line = f"{what}; dense from rows: {dense}"
    else:
        return entry["kind"]
    made = entry["made"]
    evidence = "no rounds or time recorded"
    if isinstance(made, (int, float)):
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(made))
        evidence = f"medians; rounds spread {entry['noise']:.0%}, made {when}"
    recheck = f"; the next start measures it again: {entry['recheck']}" if entry["recheck"] else ""
    return f"{line} ({evidence}){recheck}"


def _rows(pairs: list[tuple[str, Any]]) -> list[str]:
    """'  key   value' lines; a list value goes one item a line under its key."""
    out = []
    for key, value in pairs:
        if isinstance(value, list):
            out += [f"  {key}", *(f"      {v}" for v in value)] if value else [f"  {key:<22} (none)"]
        else:
            out.append(f"  {key:<22} {value}")
    return out


def _section(title: str, value: Any, rows: Callable[[dict], list[tuple[str, Any]]]) -> list[str]:
    if isinstance(value, str):  # the section itself failed
        return [title, f"  {value}"]
    return [title, *_rows(rows(value))]


def format(info: dict[str, Any]) -> str:
    """collect()'s result as text to paste into a bug report."""
    out = _section("versions", info["versions"], lambda v: list(v.items()))
    out += _section("cpu", info["cpu"], lambda c: [
        ("model", c["model"]), ("flags", " ".join(c["flags"]) or "(none read)"),
        ("C kernel ISA level", f"{c['isa_level']} (native {c['native_level']}; KVSERVE_CPU_ISA lowers it)"),
        ("cores", f"{c['usable_cores']} usable of {c['cpu_count']}")])
    out += _section("torch", info["torch"], lambda t: [
        ("cpu capability", t["cpu_capability"]), ("parallel backend", t["parallel_backend"]),
        ("threads", f"{t['threads']} intra-op, {t['interop_threads']} inter-op"),
        ("OMP_NUM_THREADS", t["OMP_NUM_THREADS"] or "not set"),
        ("waiting threads", t["wait_policy"]), ("adaptive threads", t["adaptive"]),
        ("cuda", "none (a CPU build)" if t["cuda"] is None else
         f"{t['cuda']} ({'a device' if t['cuda_available'] else 'no device'} available)")])
    out += _section("C kernels", info["c_kernels"], lambda k: [
        ("compiler", f"{k['compiler']}: {k['compiler_version']}" if k["compiler"] else "none (set CC or install gcc)"),
        *((name, _loads(k[name])) for name, _, _ in C_KERNELS),
        ("AMX tiles", "used for bfloat16 prefill matmuls and attention (KVSERVE_AMX=0: not)" if k["amx"] is True
         else "not used (no AMX-BF16, an AVX2 or lower build, KVSERVE_AMX=0, or Linux refused the tile state)"
         if k["amx"] is False else k["amx"])])
    out += ["memory", *_rows([("read bandwidth", _bandwidth_line(info["memory_bandwidth"]))])]
    out += _section("cache", info["cache"], lambda c: [
        ("dir", c["dir"]), ("kernels/", c["kernels"]),
        ("tuning/", [f"{e['file']}: {_tuning_line(e)}" for e in c["tuning"]])])
    d = info["dtype_auto"]
    if isinstance(d, str):
        auto = d
    elif d["float32_kernels"]:
        auto = f"{d['dtype']} (its linears run in the CPU kernels, which compute in float32)"
    elif d["measured"]:
        auto = f"{d['dtype']} (measured on its {d['intermediate']}x{d['hidden']} linear at {d['threads']} threads)"
    else:
        from kvserve.kernels.tuning import TUNING_ENV

        auto = f"{d['dtype']} (by the CPU's flags: {TUNING_ENV}=off)"
    out += ["default model", *_rows([("path", info["default_model"]), ("--dtype auto on CPU", auto)])]
    out += ["environment", *_rows(list(info["env"].items()))]
    if not info["env"]:
        out.append("  (none of KVSERVE_*, " + ", ".join(ENV_VARS) + " set)")
    return "\n".join(out)

"""Does a first start on a busy machine choose what a quiet one chooses? (issue 30's cold-start check)

    .venv/bin/python scripts/check_cold_start.py [--model FILE] [--burners 2] [--out FILE.json]

Three first starts, one after the other: quiet, busy, quiet. Each runs `kvserve tune --model FILE`
(the engine started once, every decision measured) in its own empty KVSERVE_CACHE_DIR, so nothing
cached helps it, as on a machine's first start; then reads its decisions back as `kvserve env`
reports them (the chosen dtype; per quantized weight shape the activation mode, the batch size
from which dequantize + dense matmul runs, and that matmul's dtype). The busy start has --burners
CPU-bound processes (busy loops, by default one per core) running beside it from before it starts
until it ends. Two quiet starts show how far the rule agrees with itself, so a difference only
the busy start has is the one the check is about.

Prints each start's decisions and where the busy one differs from the quiet ones; exits 1 if it
chose another dtype or activation mode than both quiet starts (dense_from thresholds are reported,
not judged: a crossover batch size between two measured grid points can land on either).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BURN = "while True:\n    pass\n"


def start(model: str | None, cache: Path, burners: int, extra: list[str]) -> dict:
    """One first start in an empty cache: seconds taken and the decisions `kvserve env` reports."""
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(cache)}
    burn = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(burners)]
    try:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "kvserve.cli", "tune", *(["--model", model] if model else []), *extra]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        took = time.perf_counter() - t0
    finally:
        for p in burn:
            p.kill()
            p.wait()
    if run.returncode != 0:
        raise SystemExit(f"kvserve tune failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    # the decisions this start cached, as `kvserve env` reads them
    code = "import json, kvserve.env as e; print(json.dumps(e._cache()['tuning']))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    decisions = {}
    for entry in json.loads(out.stdout):
        if entry.get("kind") == "dtype":
            decisions["dtype"] = entry.get("chosen")
        elif entry.get("kind") == "linears":
            decisions["activations"] = entry.get("activations")
            decisions["dense_from"] = entry.get("dense_from")
            decisions["dense_dtype"] = entry.get("dense_dtype")
            decisions["int8_from"] = entry.get("int8_from")
            decisions["noise"] = entry.get("noise")
    return {"seconds": took, "burners": burners, "decisions": decisions,
            "log": [line for line in run.stdout.splitlines() if line.strip()]}


def differences(a: dict, b: dict) -> list[str]:
    out = []
    for key in ("dtype", "activations"):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {a.get(key)} vs {b.get(key)}")
    for key in ("int8_from", "dense_from", "dense_dtype"):
        x, y = a.get(key) or {}, b.get(key) or {}
        for shape in sorted(set(x) | set(y)):
            if x.get(shape) != y.get(shape):
                out.append(f"{key}[{shape}]: {x.get(shape)} vs {y.get(shape)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model path (default: the default model)")
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="busy loops beside the busy start")
    ap.add_argument("--out", default=None, help="write the starts and their differences here (JSON)")
    ap.add_argument("extra", nargs="*", help="more engine flags for kvserve tune (after --)")
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-cold-") as tmp:
        for name, burners in (("quiet 1", 0), ("busy", args.burners), ("quiet 2", 0)):
            runs[name] = start(args.model, Path(tmp) / name.replace(" ", ""), burners, args.extra)
            d = runs[name]["decisions"]
            print(f"{name} ({burners} busy loops beside it): {runs[name]['seconds']:.0f} s", flush=True)
            for line in runs[name]["log"]:
                print(f"    {line}")
            print(f"  dtype {d.get('dtype', '(not measured)')}, activations {d.get('activations')}, "
                  f"int8 from {d.get('int8_from')}, dense from {d.get('dense_from')}, "
                  f"dense dtype {d.get('dense_dtype')}", flush=True)
    q1, busy, q2 = (runs[n]["decisions"] for n in ("quiet 1", "busy", "quiet 2"))
    report = {"quiet 1 vs quiet 2": differences(q1, q2), "busy vs quiet 1": differences(busy, q1),
              "busy vs quiet 2": differences(busy, q2)}
    for name, diff in report.items():
        print(f"{name}: {'same' if not diff else '; '.join(diff)}")
    # what the check judges: the choices a start makes for every step (dtype, activation mode)
    judged = [k for k in ("dtype", "activations") if busy.get(k) not in (q1.get(k), q2.get(k))]
    print("busy start: " + ("same dtype and activations as a quiet one" if not judged
                            else f"differs from both quiet starts in {', '.join(judged)}"))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs, "differences": report},
                                             indent=1))
    return 1 if judged else 0


if __name__ == "__main__":
    raise SystemExit(main())

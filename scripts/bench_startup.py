"""How long `kvserve serve` takes to answer /health, and to exit after SIGTERM.

    python scripts/bench_startup.py [--model PATH] [--runs 5] [--repo DIR] [-- more serve flags]

Each run starts `python -m kvserve.cli serve` from --repo (default: this checkout), polls
/health every 50 ms until it answers 200, then sends SIGTERM and waits for the process to exit.
Prints each run and the medians. --repo lets the same script time another checkout (a git
worktree of an older commit) with the same Python environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def one_run(repo: Path, args: list[str], log: Path) -> tuple[float, float]:
    port = _free_port()
    t0 = time.monotonic()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *args, "--port", str(port)],
                                cwd=repo, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(repo)))
    try:
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None:
                sys.exit(f"the server exited with {proc.returncode}; see {log}")
            time.sleep(0.05)
        up = time.monotonic() - t0
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return up, time.monotonic() - t1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    p.add_argument("--log", type=Path, default=Path("/tmp/kvserve-bench-startup.log"))
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    serve_args = ([args.model] if args.model else []) + extra
    ups, downs = [], []
    for i in range(args.runs):
        up, down = one_run(args.repo, serve_args, args.log)
        ups.append(up)
        downs.append(down)
        print(f"run {i + 1}: healthy after {up:.2f} s, exited {down:.2f} s after SIGTERM", flush=True)
    print(f"median: healthy after {statistics.median(ups):.2f} s, exit {statistics.median(downs):.2f} s "
          f"({args.runs} runs, {' '.join(serve_args) or 'default model'})")


if __name__ == "__main__":
    main()

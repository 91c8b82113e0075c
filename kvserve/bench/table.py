"""What both bench reports (throughput, serve) print: an aligned table, and the host CPU's name."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render_table(rows: list[tuple[str, str]], footer: list[str]) -> str:
    """Aligned `name  value` rows between two rules, then free-form footer lines."""
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows] + footer
    rule = "-" * min(100, max(len(line) for line in lines))
    return "\n".join([rule, *lines, rule])

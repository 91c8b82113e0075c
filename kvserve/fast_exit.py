"""Ending a kvserve process without the interpreter's teardown.

A process that has imported torch and transformers spends about a second (0.8 s for torch
alone, on a Zen 3 core) freeing modules after its last line, and a server stop pays that
once per process: the server, its engine, each rank. Each of those entry points closes what
it owns (engine, sockets, KV tiers, child processes) first, then calls `exit_process`: the
atexit handlers still run and stdio is flushed, only the module teardown is skipped.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_process(code: int | None) -> NoReturn:
    """Like sys.exit(code) (None is 0) from a process that has closed what it owns."""
    atexit._run_exitfuncs()  # logging, multiprocessing's child joins, anything else registered
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or None under pythonw
            pass
    os._exit(0 if code is None else code)

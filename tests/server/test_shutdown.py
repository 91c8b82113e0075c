"""Stopping a server with a disk tier, through real processes: every stop signal path saves the
KV (README: "the disk tier survives a restart"), and a SIGKILL mid-run plus damaged entries
restart with correct outputs, the valid entries reused."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time

import pytest

from tests.serving import MODEL, TINY_SERVER_ARGS, engine_pid, http_request, is_alive, running_server

BS = 16
# (who gets the signal, which signal): a process-group signal is what Ctrl-C in a terminal,
# systemd's default KillMode and `kill -- -PGID` send. Each process gets a signal, and each signal
# reaches the engine once (test_lifecycle.py stops the server with both, its streams open); each
# path costs a server start.
STOP_PATHS = [("group", signal.SIGTERM), ("group", signal.SIGINT), ("engine", signal.SIGINT),
              ("server", signal.SIGTERM)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def _prompt(seed: int, length: int = 90) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def _complete(base: str, prompt: list[int]) -> dict:
    status, body, _ = http_request("POST", f"{base}/v1/completions",
                                   {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                    "ignore_eos": True}, timeout=120)
    assert status == 200, body
    out = json.loads(body)
    return {"text": out["choices"][0]["text"], "details": out["usage"]["prompt_tokens_details"]}


def _stop(srv, target: str, sig: int) -> None:
    """Send `sig` to the server, its engine process, or the whole group; wait for a clean exit."""
    engine = engine_pid(srv.proc.pid)
    if target == "group":
        os.killpg(srv.proc.pid, sig)
    elif target == "engine":
        os.kill(engine, sig)
    else:
        srv.proc.send_signal(sig)
    try:
        code = srv.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within 60 s after {sig.name} to the {target}:\n{srv.log_text()}")
    assert code == 0, f"exit code {code} after {sig.name} to the {target}:\n{srv.log_text()}"
    deadline = time.monotonic() + 10
    while is_alive(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(engine), f"the engine process outlived the server ({sig.name} to the {target})"


def test_every_stop_signal_path_saves_the_disk_tier(model_dir, tmp_path):
    """Each path stops a server that has just served a new prompt; the next server, on the same
    directory, must find that prompt's blocks on disk."""
    disk = tmp_path / "kv"
    args = [model_dir, *TINY_SERVER_ARGS, "--kv-offload-disk", str(disk)]
    log = tmp_path / "log"
    previous = None
    for i, path in enumerate([*STOP_PATHS, None]):
        with running_server(args, log, new_session=True) as srv:
            if previous is not None:
                (target, sig), prompt, text = previous
                again = _complete(srv.base, prompt)
                reused = again["details"].get("cached_tokens_by_tier", {}).get("disk", 0)
                assert reused == 5 * BS, (f"after {sig.name} to the {target}, the next start reused {reused} "
                                          f"tokens from disk: {again['details']}")
                assert again["text"] == text
            if path is None:
                break
            prompt = _prompt(i)
            first = _complete(srv.base, prompt)
            assert first["details"]["cached_tokens"] == 0
            _stop(srv, *path)
            assert len(list(disk.rglob("*.kv"))) >= 5 * (i + 1), f"{path[1].name} to the {path[0]}: blocks not saved"
            previous = path, prompt, first["text"]


def test_sigkill_mid_run_and_damaged_entries_restart_correct(model_dir, tmp_path):
    """SIGKILL to the whole group while requests run and blocks are being written to disk, then
    damaged entries (a flipped byte, a truncation, a stray temp file): the next server gives the
    same outputs, reuses the valid entries, and deletes the damaged ones it reads."""
    disk = tmp_path / "kv"
    # 16 blocks: each request's 6 blocks evict older ones to disk while the next ones run.
    args = [model_dir, "--dtype", "float32", "--num-kv-blocks", "16", "--served-model-name", MODEL,
            "--kv-offload-disk", str(disk)]
    prompts = [_prompt(100 + i) for i in range(8)]
    texts = []
    with running_server(args, tmp_path / "log1", new_session=True) as srv:
        texts = [_complete(srv.base, p)["text"] for p in prompts[:6]]
        # A request in flight while evicted blocks are written: then SIGKILL everything.
        def more() -> None:
            for p in prompts[6:]:
                with contextlib.suppress(OSError):  # the SIGKILL cuts them off
                    http_request("POST", f"{srv.base}/v1/completions",
                                 {"model": MODEL, "prompt": p, "max_tokens": 64, "ignore_eos": True}, timeout=60)

        threading.Thread(target=more, daemon=True).start()
        time.sleep(0.3)
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
    files = sorted(disk.rglob("*.kv"))
    assert len(files) >= 10, f"only {len(files)} entries reached the disk before the SIGKILL"
    damaged = {}
    for n, f in enumerate(files[::3]):
        raw = f.read_bytes()
        damaged[f] = raw[: len(raw) // 2] if n % 2 else raw[:40] + bytes([raw[40] ^ 0xFF]) + raw[41:]
        f.write_bytes(damaged[f])
    (files[0].parent / ".kvtmp-killed-writer").write_bytes(b"partial")
    with running_server(args, tmp_path / "log2") as srv:
        again = [_complete(srv.base, p) for p in prompts[:6]]
        assert [a["text"] for a in again] == texts
        reused = sum(a["details"].get("cached_tokens_by_tier", {}).get("disk", 0) for a in again)
        assert reused > 0, [a["details"] for a in again]
        assert "Traceback" not in srv.log_text()
    # A damaged entry that was read is deleted (and may be written again, whole, when evicted).
    still = [f for f, raw in damaged.items() if f.exists() and f.read_bytes() == raw]
    assert len(still) < len(damaged), "no damaged entry was found bad and deleted"

"""A process tree goes away whole however its top goes (issue 31): SIGKILL a busy `kvserve serve`,
or a busy replica behind `kvserve router --launch`, and within 5 s no process of its tree is left,
the engine having stopped generating within 1 s and saved the disk tier as on SIGTERM, and its
temp directory is gone. Temp directories of dead processes are removed, live ones kept."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine_proc import SEND_TIMEOUT_MS, ParentLink
from kvserve.engine.wire import decode
from kvserve.kv_tiers.codec import decode_entry
from kvserve.kv_tiers.disk import DiskTier
from kvserve.lifetime import OWNER_FILE, keep_temp_dir, make_temp_dir, owner_line, remove_stale_temp_dirs
from tests.router import router_procs
from tests.router.router_procs import spawn_router, wait_router
from tests.serving import child_pids, http_request, is_alive, running_server

GONE_BOUND_S = 5.0  # every process of the killed tree has exited (issue 31)
NOTICE_BOUND_S = 1.0  # the engine has stopped generating for its dead parent (issue 31)
BS = 16
ENGINE_ARGS = ["--num-kv-blocks", "64", "--max-model-len", "1024"]  # the default model, a small pool
NOTICE = "has exited; saving the KV tiers and exiting"  # the engine's line when its parent died
SHORT = list(range(200, 280))  # 5 full blocks, finished before the long request starts
LONG = list(range(300, 390))  # 5 full blocks and 10 tokens, then a generation far longer than the test


def descendants(pid: int) -> list[int]:
    return [d for c in child_pids(pid) for d in (c, *descendants(c))]


class Generation:
    """A streamed completion running in a thread; `events` counts its token events."""

    def __init__(self, base: str, prompt: list[int], max_tokens: int = 900) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                     "stream": True}
        self.events = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, http.client.HTTPException):  # the kill cuts it off
            self.conn.request("POST", "/v1/completions", json.dumps(self.body),
                              {"content-type": "application/json"})
            for line in self.conn.getresponse():
                self.events += line.startswith(b"data: {")

    def wait_events(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.events < n:
            assert time.monotonic() < deadline, f"only {self.events} token events after {timeout} s"
            time.sleep(0.02)


def complete(base: str, prompt: list[int]) -> None:
    status, body, _ = http_request("POST", f"{base}/v1/completions",
                                   {"prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=120)
    assert status == 200, body


def kill_busy(victim: int, gen: Generation, log: Path) -> int:
    """SIGKILL `victim` while `gen` streams; within the bounds, measured from the kill, the engine
    logs that its parent died and the whole tree is gone. Returns the token events seen before."""
    tree = [victim, *descendants(victim)]
    assert len(tree) >= 2, f"no engine process under {victim}"
    gen.wait_events(40)
    seen = gen.events
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    notice = gone = None
    while gone is None and time.monotonic() - t0 < 30:
        now = time.monotonic() - t0
        if notice is None and NOTICE in log.read_text(errors="replace"):
            notice = now
        if not any(is_alive(p) for p in tree):
            gone = now
        time.sleep(0.02)
    if notice is None and NOTICE in log.read_text(errors="replace"):
        notice = gone
    print(f"SIGKILL of busy pid {victim} after {seen} token events: the engine noticed in "
          f"{notice if notice is None else round(notice, 3)} s, the tree of {len(tree)} processes was "
          f"gone in {gone if gone is None else round(gone, 3)} s")
    assert gone is not None and gone <= GONE_BOUND_S, (
        f"left after {GONE_BOUND_S} s: {[p for p in tree if is_alive(p)]}\n{log.read_text()[-3000:]}")
    assert notice is not None and notice <= NOTICE_BOUND_S, (
        f"the engine noticed after {notice} s:\n{log.read_text()[-3000:]}")
    assert seen < gen.body["max_tokens"]  # it was still generating when killed
    return seen


def check_saved(disk: Path, tokens_seen: int) -> None:
    """The disk tier holds what a SIGTERM saves, every block the device cache held: the full
    blocks of SHORT and of LONG plus its tokens generated before the kill, each entry intact."""
    tier = DiskTier(disk, 1 << 40)
    saved = [tuple(decode_entry(k, tier.get(k))[0]["tokens"]) for k in tier.keys_lru()]
    for prompt in (SHORT, LONG):
        missing = [i for i in range(len(prompt) // BS) if tuple(prompt[i * BS:(i + 1) * BS]) not in saved]
        assert not missing, f"prompt blocks {missing} not saved; {len(saved)} entries on disk"
    least = len(SHORT) // BS + (len(LONG) + tokens_seen) // BS
    print(f"{len(saved)} blocks saved to disk, at least {least} expected")
    assert len(saved) >= least, f"{len(saved)} blocks on disk, the device held at least {least}"


def owned_by(root: Path, pid: int) -> list[Path]:
    return [d for d in root.glob("kvserve-*")
            if (d / OWNER_FILE).exists() and (d / OWNER_FILE).read_text().split()[1] == str(pid)]


# ---- through real processes --------------------------------------------------------------------

def test_sigkill_of_a_busy_server_leaves_nothing_running_and_saves_the_disk_tier(tmp_path, monkeypatch):
    tmp, disk, log = tmp_path / "tmp", tmp_path / "kv", tmp_path / "server.log"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the server's temp directories go here
    with running_server([*ENGINE_ARGS, "--kv-offload-disk", str(disk)], log) as srv:
        assert len(owned_by(tmp, srv.proc.pid)) == 1  # its ipc sockets' directory, owner recorded
        complete(srv.base, SHORT)
        gen = Generation(srv.base, LONG)
        seen = kill_busy(srv.proc.pid, gen, log)
        srv.proc.wait(5)
    assert list(tmp.iterdir()) == [], "the killed server's temp directory was left behind"
    check_saved(disk, seen)


def test_sigkill_of_a_busy_launched_replica_leaves_nothing_running(tmp_path, monkeypatch):
    tmp, disk = tmp_path / "tmp", tmp_path / "kv"
    tmp.mkdir()
    monkeypatch.setitem(router_procs.ENV, "TMPDIR", str(tmp))  # the router's and its replica's
    r = spawn_router(["--launch", "1", "--health-interval", "1", "--", *ENGINE_ARGS, "--kv-offload-disk", str(disk)],
                     tmp_path / "router.log")
    try:
        wait_router(r, 240)
        (replica,) = r.replicas().values()
        pid = replica["pid"]
        (log,) = (d / "replica-0.log" for d in owned_by(tmp, r.proc.pid))
        complete(r.base, SHORT)
        seen = kill_busy(pid, Generation(r.base, LONG), log)
        assert r.proc.poll() is None, "the router went down with its replica"
        assert owned_by(tmp, pid) == [], "the killed replica's temp directory was left behind"
        check_saved(disk, seen)
    finally:
        r.stop()


def test_the_engine_outlives_the_thread_that_started_it():
    """The kernel sends the parent-death signal also when the parent's thread that started the
    engine exits: the engine stops only when the parent process has gone."""
    started: dict[str, AsyncEngine] = {}

    async def start() -> None:
        started["engine"] = await AsyncEngine.start(num_kv_blocks=64, max_model_len=1024)

    t = threading.Thread(target=asyncio.run, args=(start(),))
    t.start()
    t.join()
    engine = started["engine"]
    time.sleep(1.5)  # three idle polls, and the signal (if it were obeyed) long delivered
    assert is_alive(engine.pid), "the engine stopped when the thread that started it exited"
    asyncio.run(engine.shutdown())
    assert not is_alive(engine.pid)


# ---- the parts, in this process ----------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _temp_dir(root: Path, name: str, owner: str | None) -> Path:
    d = root / name
    d.mkdir()
    if owner is not None:
        (d / OWNER_FILE).write_text(owner)
    (d / "input").write_bytes(b"")
    return d


def test_stale_temp_dirs_of_dead_owners_are_removed_and_live_ones_kept(tmp_path):
    ns, me, start = owner_line().split()
    dead = f"{ns} {_dead_pid()} 1"
    root, outside = tmp_path / "tmp", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "precious").write_text("not kvserve's")
    gone = [_temp_dir(root, "kvserve-dead", dead), _temp_dir(root, "kvserve-mp-dead", dead),
            _temp_dir(root, "kvserve-reused", f"{ns} {me} {int(start) + 1}")]  # our pid, another start
    os.symlink(outside / "precious", gone[0] / "link")  # removing the link must not follow it
    os.symlink(outside, gone[0] / "dirlink")
    kept = [_temp_dir(root, "kvserve-live", owner_line()),
            _temp_dir(root, "kvserve-other-ns", f"1 {_dead_pid()} 1"),  # a pid namespace we cannot see
            _temp_dir(root, "kvserve-no-owner", None),
            _temp_dir(root, "kvserve-garbled", "not an owner line"),
            _temp_dir(root, "other-dead", dead),
            _temp_dir(root, "kvserve-kept", dead)]
    keep_temp_dir(str(kept[-1]))  # logs kept on purpose
    owner_link = _temp_dir(root, "kvserve-owner-link", None)
    (outside / "owner").write_text(dead)
    os.symlink(outside / "owner", owner_link / OWNER_FILE)
    target = _temp_dir(outside, "kvserve-target", dead)
    os.symlink(target, root / "kvserve-symlink")
    kept += [owner_link, root / "kvserve-symlink", target]
    removed = remove_stale_temp_dirs(str(root))
    assert sorted(removed) == sorted(map(str, gone))
    assert not any(d.exists() for d in gone)
    assert all(d.exists() for d in kept) and os.path.islink(root / "kvserve-symlink")
    assert (outside / "precious").read_text() == "not kvserve's" and (outside / "owner").exists()


def test_make_temp_dir_records_its_owner_after_removing_stale_ones(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    ns, _, _ = owner_line().split()
    stale = _temp_dir(tmp_path, "kvserve-router-old", f"{ns} {_dead_pid()} 1")
    d = Path(make_temp_dir("kvserve-router-"))
    assert not stale.exists() and d.parent == tmp_path and d.name.startswith("kvserve-router-")
    assert (d / OWNER_FILE).read_text() == owner_line()
    assert remove_stale_temp_dirs() == [] and d.exists()
    shutil.rmtree(d)


def test_die_with_parent_reports_a_parent_that_died_first(tmp_path):
    """The race: the parent exits before the child asks for the signal; no signal will come."""
    out = tmp_path / "out"
    child = ("import os, sys, time; from kvserve.lifetime import die_with_parent; time.sleep(1); "
             f"open({str(out)!r}, 'w').write(str(die_with_parent(15, int(sys.argv[1]))))")
    parent = ("import os, subprocess, sys; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())]); os._exit(0)")
    subprocess.run([sys.executable, "-c", parent], check=True, cwd=Path(__file__).parents[2])
    deadline = time.monotonic() + 30
    while not out.exists() or not out.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert out.read_text() == "False"
    probe = "import os, signal; from kvserve.lifetime import die_with_parent; print(die_with_parent(0, os.getppid()))"
    alive = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert alive.stdout.strip() == "True"


def test_sends_to_a_parent_that_stopped_reading_are_dropped_not_blocked(tmp_path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/output"
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1)
    sock.connect(addr)  # nobody binds: the queue fills and then nothing drains it
    try:
        live = ParentLink(sock, os.getppid())
        dead = ParentLink(sock, _dead_pid())
        assert live.send({"type": "outputs", "n": 0})  # queued
        for link, give_up in ((dead, lambda: False), (live, lambda: True)):
            t0 = time.monotonic()
            assert not link.send({"type": "outputs", "n": 1}, give_up)
            took = time.monotonic() - t0
            print(f"a full queue: dropped after {took:.3f} s")
            assert SEND_TIMEOUT_MS / 1000 * 0.9 <= took < SEND_TIMEOUT_MS / 1000 + 1.0
        pull = ctx.socket(zmq.PULL)
        pull.bind(addr)  # a reader at last: the queued message arrives, the dropped one never does
        assert pull.poll(5000) and decode(pull.recv())["n"] == 0
        assert not pull.poll(300)
        pull.close(0)
    finally:
        sock.close(0)
        ctx.term()


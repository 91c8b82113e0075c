"""What a kvserve process leaves behind when it goes away, however it goes.

A child process (the engine, a rank, a launched replica) asks the kernel for a signal when
its parent dies (`die_with_parent`), so a SIGKILLed server leaves no engine running on. Temp
directories (ipc sockets, logs) name their owner process in a file inside; `make_temp_dir`
first removes the kvserve ones whose owner is provably dead, which a SIGKILL leaves behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import stat
import tempfile

TEMP_PREFIX = "kvserve-"
OWNER_FILE = "owner"  # '<pid namespace inode> <pid> <start time in clock ticks>' of the creator
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent: int) -> bool:
    """Linux: the kernel sends `sig` to this process when its parent exits. False if `parent`
    (the pid that started this process) is already gone: it died before the request, and no
    signal will come.

    The kernel also sends it when the parent's *thread* that started this process exits while
    the parent lives on; a handler that must not act then checks os.getppid() != parent.
    """
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the callers' getppid checks remain
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    return os.getppid() == parent


def _proc_stat(pid: int | str) -> tuple[str, str] | None:
    """(state, start time in clock ticks after boot) of a process from /proc, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str | None:
    """This process's pid namespace, if /proc shows the processes of that namespace."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None  # /proc of another namespace: its pids are not ours
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def owner_line() -> str | None:
    """What OWNER_FILE holds for a directory this process creates; None without /proc."""
    ns, st = _pid_namespace(), _proc_stat("self")
    return None if ns is None or st is None else f"{ns} {os.getpid()} {st[1]}"


def owner_is_dead(line: str) -> bool:
    """Whether the process an OWNER_FILE line names has provably exited: same pid namespace as
    this process, and no process with that pid, a zombie, or one started at another time (the
    pid reused)."""
    try:
        ns, pid_s, start = line.split()
        pid = int(pid_s)
    except ValueError:
        return False
    if pid <= 0 or ns != _pid_namespace():
        return False  # a process we cannot see may be alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # there is one, another user's: a reused pid if its start time differs
    now = _proc_stat(pid)
    return now is not None and (now[1] != start or now[0] in ("Z", "X"))


def _read_owner(path: str) -> str | None:
    """OWNER_FILE of a directory of this user's, never following a symlink; None if absent."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode) or os.fstat(f.fileno()).st_uid != os.getuid():
                return None
            return f.read(256).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(dfd)


def remove_stale_temp_dirs(root: str | None = None) -> list[str]:
    """Remove the kvserve temp directories under `root` (the system temp directory) whose owner
    has exited; returns their paths. Only directories (not symlinks) of this user named
    TEMP_PREFIX* with an OWNER_FILE naming a dead process qualify; nothing else is touched, and
    removal never follows a symlink."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(TEMP_PREFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        line = _read_owner(e.path)
        if line is None or not owner_is_dead(line):
            continue
        try:
            shutil.rmtree(e.path)  # fd-based on Linux: it refuses a symlink and follows none inside
        except OSError:
            continue  # removed meanwhile by another kvserve process, or not ours to remove after all
        removed.append(e.path)
    return removed


def make_temp_dir(prefix: str) -> str:
    """tempfile.mkdtemp(prefix=prefix) (a TEMP_PREFIX* name) owned by this process, after the stale
    kvserve temp directories left by processes that were killed are removed."""
    assert prefix.startswith(TEMP_PREFIX), prefix
    remove_stale_temp_dirs()
    path = tempfile.mkdtemp(prefix=prefix)
    line = owner_line()
    if line is not None:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(line)
    return path


def keep_temp_dir(path: str) -> None:
    """Keep a make_temp_dir directory after its owner exits (logs worth reading after a failure):
    without its OWNER_FILE no later sweep removes it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, OWNER_FILE))

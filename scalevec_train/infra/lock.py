"""One holder at a time of a folder (a run directory, a data cache), across processes and hosts that
share its file system; docs/guides/reliability.md, "One writer per run directory".

The lock is `<folder>/.lock`. Its holder keeps an flock on it (released by the kernel when the
holder dies, however it dies) and writes its record there: host, pid, start time, and a beat that a
thread advances every BEAT seconds. Releasing empties the file. Whoever comes next:

- cannot take the flock: a live process holds it (on this host, or on another where flock reaches
  the whole file system, as on NFSv4): the holder is named at once;
- takes the flock and finds an empty file: free;
- finds a record of this host: its writer is gone (it would hold the flock, or, where flock does not
  work, its pid is no longer alive): taken over at once;
- finds a record of another host: flock may not reach across hosts there (NFS mounted with
  local_lock, BeeGFS and Lustre by default), so the beat decides: it advances within STALE seconds
  (the holder lives, named as soon as it moves) or it does not (the holder's node died: taken over).

Where flock fails outright (NFSv3 without lockd, `nolock` mounts, Lustre's `noflock`), the record
alone decides, as above: a second writer racing for a stale record is caught by re-reading it after
writing.
"""

import errno
import fcntl
import json
import os
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

NAME = ".lock"
BEAT = 10.0  # seconds between the holder's beats
STALE = 60.0  # a record of another host whose beat stood still this long is its dead holder's
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class Held(Exception):
    """The folder's lock is held by a live process; `record` names it (host, pid, started)."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record
        super().__init__(f"{path} is held by {holder(record)}")


def holder(record: dict) -> str:
    """The holder a record names, for messages."""
    return f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('started')}"


class DirLock:
    """The lock of `folder` (created if missing). acquire(wait=False) raises Held while another
    process holds it; acquire(wait=True) waits for it. release() (or leaving `with`) frees it."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / NAME
        self.fd: int | None = None
        self.record: dict | None = None
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self, wait: bool = False) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                flocked = _flock(fd, blocking=wait)
            except BlockingIOError:
                os.close(fd)
                raise Held(self.path, _read(self.path)) from None
            if not _same_file(fd, self.path):  # emptied and removed by a holder leaving (release)
                os.close(fd)
                continue
            try:
                record = _read(self.path)
                if record and not _dead(self.path, record, flocked):
                    raise Held(self.path, record)
                self.record = _mine()
                _write(fd, self.record)
                if not flocked and not _still_mine(self.path, self.record):
                    raise Held(self.path, _read(self.path))
            except Held:
                os.close(fd)
                if not wait:
                    raise
                time.sleep(min(BEAT, 1.0))
                continue
            self.fd = fd
            break
        self._stop.clear()
        self._beater = threading.Thread(target=self._beat, name=f"lock {self.path}", daemon=True)
        self._beater.start()

    def release(self) -> None:
        if self.fd is None:
            return
        self._stop.set()
        if self._beater is not None:
            self._beater.join()
        os.ftruncate(self.fd, 0)
        os.fsync(self.fd)
        os.close(self.fd)  # and with it the flock
        self.fd, self.record = None, None

    def _beat(self) -> None:
        while not self._stop.wait(BEAT):
            self.record["beat"] += 1
            try:
                _write(self.fd, self.record)
            except OSError:  # a full or failing disk: the run's own writes will say so
                pass


def _flock(fd: int, blocking: bool) -> bool:
    """Takes the flock of `fd`: True once held, False where the file system has none; raises
    BlockingIOError if another process holds it (and `blocking` is false)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return False
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            raise BlockingIOError(e.errno, e.strerror) from None
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read(path: Path) -> dict:
    """The holder's record, {} if none (released, or never held). A fresh open: on NFS that reads
    what the holder last flushed."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        record = json.loads(text) if text.strip() else {}
    except ValueError:  # a record half written by a holder that died writing it
        return {"host": "?", "pid": 0, "started": "?", "beat": -1}
    return record if isinstance(record, dict) else {}


def _write(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    # over the old record, then cut to length: never empty in between, which a reader would take for
    # a released lock (a beat's rewrite of a live holder's record, or a holder killed in the middle
    # of one)
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)  # visible to other hosts (NFS writes back at close or fsync)


def _mine() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "ticks": _start_ticks(os.getpid()),
            "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"), "beat": 0}


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot; None without /proc): a pid reused by a
    new process has another."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _dead(path: Path, record: dict, flocked: bool) -> bool:
    """Whether the process that wrote `record` no longer holds the lock
    (see the module's docstring)."""
    if record.get("host") == socket.gethostname():
        return flocked or not _runs(record)
    deadline = time.monotonic() + STALE
    while time.monotonic() < deadline:
        time.sleep(min(BEAT / 4, 1.0))
        if _read(path) != record:
            return False
    return True


def _runs(record: dict) -> bool:
    """Whether the process of this host that wrote `record` still runs: its pid, started when it
    was."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if record.get("ticks") is not None:
        return _start_ticks(pid) == record["ticks"]
    try:  # no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def _still_mine(path: Path, record: dict) -> bool:
    """Without flock, two processes may both find a dead holder's record and write their own: each
    reads the file again a moment later, and the one whose record is gone steps back."""
    time.sleep(min(BEAT / 4, 1.0))
    return _read(path) == record

"""One holder at a time of a folder (scalevec_train/infra/lock.py), between real processes: a live
holder is named at once, a dead one (SIGKILL) is taken over at once; where flock fails
(NFS without lockd) the holder's record decides, by its pid on the same host and by its beat across
hosts; and the data cache's lock is waited for by writers, never taken by readers of prepared
data."""

import errno
import fcntl
import json
import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from scalevec_train.data import prepare_data
from scalevec_train.infra import lock as lock_module
from scalevec_train.infra.lock import DirLock, Held

# The holders are children forked from a fork server that import this module: it imports no torch.


def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")


def hold(folder: str, ready, host: str | None, without_flock: bool) -> None:
    """A child process that takes the folder's lock and keeps it (as another host, `host`; on a file
    system without flock) until it is killed."""
    if without_flock:
        fcntl.flock = no_flock
    if host is not None:
        socket.gethostname = lambda: host
    lock_module.BEAT = 0.1
    DirLock(Path(folder)).acquire()
    ready.set()
    time.sleep(600)


def start_holder(folder: Path, host: str | None = None, without_flock: bool = False):
    context = multiprocessing.get_context("forkserver")
    ready = context.Event()
    child = context.Process(target=hold, args=(str(folder), ready, host, without_flock),
                            daemon=True)
    child.start()
    assert ready.wait(120), "the holder never took the lock"
    return child


def kill(child) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.join()


def refused_by(folder: Path) -> dict:
    with pytest.raises(Held) as info:
        DirLock(folder).acquire()
    return info.value.record


@pytest.mark.parametrize("without_flock", [False, True], ids=["flock", "no_flock"])
def test_a_live_holder_is_named_at_once_and_a_killed_one_is_taken_over_at_once(
        without_flock, tmp_path, monkeypatch):
    if without_flock:
        monkeypatch.setattr(fcntl, "flock", no_flock)
    child = start_holder(tmp_path, without_flock=without_flock)
    start = time.monotonic()
    record = refused_by(tmp_path)
    assert time.monotonic() - start < 5
    assert ((record["host"], record["pid"]) == (socket.gethostname(), child.pid)
            and "UTC" in record["started"])
    kill(child)
    start = time.monotonic()
    with DirLock(tmp_path) as lock:
        lock.acquire()
        assert time.monotonic() - start < 5
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        assert refused_by(tmp_path)["pid"] == os.getpid()  # held by this process now
    assert lock.path.read_text() == ""  # released: nothing left to take over


@pytest.mark.parametrize("without_flock", [False, True], ids=["local_flock", "no_flock"])
def test_a_holder_on_another_host_is_known_by_its_beat(without_flock, tmp_path, monkeypatch):
    """Where flock does not reach across hosts (or fails), a record of another host holds while its
    beat moves, and is taken over once it stands still for STALE seconds
    (the holder's node is gone)."""
    monkeypatch.setattr(lock_module, "BEAT", 0.1)
    monkeypatch.setattr(lock_module, "STALE", 2.0)
    # flock of the other host's process is invisible here, as on a file system whose flock is per
    # node
    child = start_holder(tmp_path, host="node-b", without_flock=True)
    if without_flock:
        monkeypatch.setattr(fcntl, "flock", no_flock)
    assert refused_by(tmp_path)["host"] == "node-b"
    kill(child)
    start = time.monotonic()
    with DirLock(tmp_path) as lock:
        lock.acquire()
        waited = time.monotonic() - start
    assert 2.0 <= waited < 10, waited


def test_two_newcomers_to_a_dead_holder_without_flock_leave_one_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(fcntl, "flock", no_flock)
    kill(start_holder(tmp_path, without_flock=True))
    context = multiprocessing.get_context("forkserver")
    outcome, done, start = context.Queue(), context.Event(), context.Barrier(2)
    racers = [context.Process(target=race, args=(str(tmp_path), outcome, done, start))
              for _ in range(2)]
    for racer in racers:
        racer.start()
    try:
        results = sorted(outcome.get(timeout=120) for _ in racers)
    finally:
        done.set()
        for racer in racers:
            racer.join()
    assert [r for r, _ in results] == ["held", "refused"]


def race(folder: str, outcome, done, start) -> None:
    """Takes the lock and keeps it until `done`, or says it was refused; both racers start at once,
    so that both find the dead holder's record (each takes it over) and the check after writing
    decides."""
    fcntl.flock = no_flock
    lock = DirLock(Path(folder))
    start.wait(120)
    try:
        lock.acquire()
    except Held:
        outcome.put(("refused", os.getpid()))
        return
    outcome.put(("held", os.getpid()))
    done.wait(120)
    lock.release()


def test_readers_of_a_prepared_cache_never_wait_for_its_lock(data_overrides, tmp_path):
    """Runs in different run directories share one data cache: one preparing
    (holding the cache's lock) never stops another from reading data that is already prepared."""
    from tests.support.helpers import make_config

    data = make_config(*data_overrides).data
    prepared = prepare_data(data)
    child = start_holder(Path(data.cache_dir))
    read = []
    reader = threading.Thread(target=lambda: read.append(prepare_data(data)), daemon=True)
    reader.start()
    reader.join(30)
    kill(child)  # (a reader waiting for the lock gets it now, and ends)
    assert read and read[0].root == prepared.root, (
        "reading prepared data waited for the cache's lock")

"""The test launcher itself (tests/support/launch.py): what a test starts dies with the test."""

import signal
import sys

from tests.support.launch import Processes


def test_processes_kill_descendants_in_sessions_of_their_own(tmp_path):
    """As torchrun's workers: a child that starts a grandchild in a new session (a process-group
    kill would miss it), then both wait forever."""
    owned = Processes(tmp_path)
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(600)'], start_new_session=True); time.sleep(600)")
    started = owned.start([sys.executable, "-c", code], tmp_path)
    started.wait_until(lambda: len(owned.pids()) == 2, "the grandchild")
    owned.kill()
    assert started.proc.returncode == -signal.SIGKILL
    assert not owned.pids()

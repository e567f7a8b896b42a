"""Leaving the process group ends it: when the training command returns on 2 gloo ranks, its groups
are freed and no gloo thread runs on (docs/guides/reliability.md, "Leaving cleanly").

A gloo group's worker threads end only when the group is freed, and destroy_process_group() does not
free a group that something still holds: FSDP2's DeviceMesh (kept by torch's DTensor caches for the
life of the process), the async checkpoint's group, a traceback's frames. Threads left running into
interpreter finalization made a rank abort now and then after a run that had saved everything.
Checked after a finished Muon run with FSDP and async checkpoints, and after a run that diverges (a
ScalevecError: exit code 3): the world group is gone (a weak reference to it is dead), and no thread
named as torch names a gloo group's threads is alive, while the same names were there when the group
was up.
"""

import json
import sys
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

from scalevec_train import train
from scalevec_train.config import compose_raw
from scalevec_train.data import prepare_data
from scalevec_train.infra.faults import FAULT_AT_ENV
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.launch import spawn
from tests.support.presets import TINY_MODEL

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads thread names from /proc")

GLOO_THREADS = {"pt_gloo_runloop", "gloo_tcp_loop"}
PF_EXITING = 0x4  # a task's flag once it has begun to exit (linux/sched.h)
RUN = [*TINY_MODEL, *(o for o in SHORT_RUN if not o.startswith("train.micro_batch=")),
       "train.micro_batch=2", "train.steps=4", "train.log_every=1"]


def gloo_threads() -> list[str]:
    """The gloo threads of this process, by name; one that is exiting counts as gone (a joined
    thread is listed until the kernel has released it)."""
    found = []
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # released meanwhile
            continue
        name, fields = (stat[stat.index("(") + 1:stat.rindex(")")],
                        stat[stat.rindex(")") + 2:].split())
        if name in GLOO_THREADS and not int(fields[6]) & PF_EXITING:
            found.append(name)
    return found


def _rank(rank: int, world: int, store: str, out: str, overrides: list[str]) -> None:
    # the command's own init() joins nothing when a group exists: this one meets in a file, not on a
    # port
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dist.barrier()  # a worker thread has run a collective: it has named itself
    during, world_group = gloo_threads(), weakref.ref(dist.group.WORLD)
    try:
        # the command's body, without Hydra's argv parsing
        train.main.__wrapped__(compose_raw(overrides))
        code = 0
    except SystemExit as e:
        code = e.code
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"code": code, "during": during, "after": gloo_threads(),
         "world_alive": world_group() is not None}))


def leave(tmp_path: Path, overrides: list[str]) -> list[dict]:
    spawn(_rank, (2, str(tmp_path / "store"), str(tmp_path), overrides))
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def common(data_overrides) -> list[str]:
    prepare_data(make_config(*data_overrides).data)  # once, not by 2 ranks at a time
    return [*data_overrides, *RUN]


def test_a_finished_run_leaves_no_gloo_thread(common, tmp_path):
    ranks = leave(tmp_path, [*common, "optim=muon", "scale=unified", "checkpoint.every=2",
                             "checkpoint.async_save=true", f"run_dir={tmp_path / 'run'}"])
    for r in ranks:
        assert r["code"] == 0
        assert "pt_gloo_runloop" in r["during"], r
        assert r["after"] == [] and not r["world_alive"], r
    assert (tmp_path / "run" / "checkpoints" / "step_000004" / "COMPLETE").is_file()


def test_a_diverged_run_leaves_no_gloo_thread(common, tmp_path, monkeypatch):
    # both ranks: the stability guard stops them at step 3
    monkeypatch.setenv(FAULT_AT_ENV, "step.loss:2=nan,step.loss:3=nan")
    ranks = leave(tmp_path, [*common, "train.max_bad_steps=2", f"run_dir={tmp_path / 'run'}"])
    for r in ranks:
        assert r["code"] == 3
        assert "pt_gloo_runloop" in r["during"], r
        assert r["after"] == [] and not r["world_alive"], r

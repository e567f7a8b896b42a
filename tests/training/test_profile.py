"""train.profile_steps: a Chrome trace per chosen step, holding that step's ProfilerStep marker and
the model's ops, and no other step; the run's numbers are those of the run without it, which writes
no profile folder."""

import json
import re

import pytest

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.train import run
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.launch import records
from tests.support.presets import TINY_MODEL

STEPS = [*TINY_MODEL, *SHORT_RUN, "train.steps=4", "train.log_every=2"]


def markers(trace: dict) -> set[str]:
    return {e["name"] for e in trace["traceEvents"]
            if re.fullmatch(r"ProfilerStep#\d+", e.get("name", ""))}


NUMBERS = ("step", "loss", "grad_norm", "val_loss", "val_bpb")


def test_chosen_steps_are_traced(tmp_path, data_overrides):
    out = run(make_config(*data_overrides, *STEPS, "train.profile_steps=[2,3]",
                          f"run_dir={tmp_path / 'r'}"))
    plain = run(make_config(*data_overrides, *STEPS, f"run_dir={tmp_path / 'plain'}"))
    assert not (plain / "profile").exists()
    assert [{k: r[k] for k in NUMBERS if k in r} for r in records(out)] == \
        [{k: r[k] for k in NUMBERS if k in r} for r in records(plain)]
    files = sorted(p.name for p in (out / "profile").iterdir())
    # on CPU: no memory snapshot
    assert files == ["step_000002.rank0.json", "step_000003.rank0.json"]
    for step in (2, 3):
        trace = json.loads((out / "profile" / f"step_00000{step}.rank0.json").read_text())
        assert markers(trace) == {f"ProfilerStep#{step}"}
        names = {e.get("name") for e in trace["traceEvents"]}
        # the forward (the matmuls of the linear maps), the backward and the optimizer step
        assert {"aten::mm", "aten::embedding",
                "Optimizer.step#AdamW.step"} <= names, sorted(names)[:50]
        assert any(n and n.startswith("autograd::engine::evaluate_function") for n in names)


def test_bad_steps_are_refused(data_overrides):
    with pytest.raises(ScalevecError, match="train.profile_steps"):
        make_config(*data_overrides, *STEPS, "train.profile_steps=[0,2]")

"""compare_runs --diagnostics: the diag/* series of two tiny runs (baseline, unified;
train.diagnostics_every) as the plot reads them, and the png it draws of them side by side."""

import importlib.util

import numpy as np
import pytest

from scalevec_analysis import load_run_dir
from scalevec_analysis.diagnostic_series import PANELS, panel_series
from scalevec_analysis.report import write_diagnostics
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.train import run
from tests.support.helpers import REPO, SHORT_RUN, load_script, make_config
from tests.support.launch import records
from tests.support.presets import TINY_MODEL

STEPS = ["train.steps=4", "train.log_every=2"]


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory, data_overrides):
    root = tmp_path_factory.mktemp("diag_runs")
    return [run(make_config(*data_overrides, *TINY_MODEL, *SHORT_RUN, *STEPS,
                            "train.diagnostics_every=2", f"scale={scale}",
                            f"run_dir={root / scale}")) for scale in ("baseline", "unified")]


def test_series_are_the_logged_values(run_dirs):
    raw = [r for r in records(run_dirs[1]) if "diag/layer0/resid_rms" in r]
    by_name = {p.stat: p for p in PANELS}
    loaded = load_run_dir(run_dirs[1])
    layers = panel_series(loaded, by_name["resid_rms"])
    assert list(layers) == ["layer 0", "layer 1", "final"]
    tokens, values = layers["layer 1"]
    assert tokens.tolist() == [r["tokens"] for r in raw] and len(raw) == 2
    assert values.tolist() == [r["diag/layer1/resid_rms"] for r in raw]
    maps = panel_series(loaded, by_name["update_ratio"])
    assert set(maps) == {"attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w_gate", "ffn.w_up",
                         "ffn.w_down", "head"}
    expected = [np.mean([r["diag/layer0/attn.wq/update_ratio"],
                         r["diag/layer1/attn.wq/update_ratio"]]) for r in raw]
    assert maps["attn.wq"][1].tolist() == pytest.approx(expected, rel=1e-12)
    # the loss beside them, and every block map's input outliers (no FP8 here: no FP8 series)
    loss = [r for r in records(run_dirs[1]) if "loss" in r]
    assert panel_series(loaded, by_name["loss"])["loss"][1].tolist() == [r["loss"] for r in loss]
    assert set(panel_series(loaded, by_name["in_kurtosis"])) == set(maps) - {"head"}
    assert panel_series(loaded, by_name["fp8_underflow"]) == {}
    # maps without an input-side scale have no gain: o and down under both strategies
    assert set(panel_series(loaded, by_name["col_gain"])) == {"attn.wq", "attn.wk", "attn.wv",
                                                              "ffn.w_gate", "ffn.w_up", "head"}


def test_a_run_without_diagnostics_is_refused(run_dirs, tmp_path, data_overrides):
    plain = run(make_config(*data_overrides, *TINY_MODEL, *SHORT_RUN, *STEPS,
                            f"run_dir={tmp_path / 'plain'}"))
    with pytest.raises(ScalevecError, match="train.diagnostics_every"):
        write_diagnostics([load_run_dir(run_dirs[0]), load_run_dir(plain)], tmp_path / "out")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the analysis extra)")
def test_compare_runs_draws_two_runs_side_by_side(run_dirs, tmp_path):
    cli = load_script(REPO / "scripts" / "compare_runs.py")
    out = tmp_path / "out"
    assert cli.main([*map(str, run_dirs), "--diagnostics", "--out", str(out)]) == 0
    png = out / "diagnostics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000

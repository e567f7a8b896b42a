"""scripts/fp8_table.py on kept runs written here: the penalty is FP8 minus bf16 of the same arm and
seed, each arm's penalty is paired with the baseline's by seed, and the outlier columns take the
largest layer at each diagnostics step of the run's second half, averaged over those steps."""

import json

import pytest

from tests.support.helpers import REPO, load_script

table = load_script(REPO / "scripts" / "fp8_table.py")
BASE, UNIFIED = "baseline-adamw-lr0.003-scale_lr0.01", "unified-adamw-lr0.003-scale_lr0.01"


def write_run(root, name, val_loss, diags):
    """A kept run: a loss at step 0 and at the end (step 100), and the diagnostics steps given as
    {step: (kurtosis of layer 0, of layer 1, underflow of layer 0, of layer 1)}."""
    run = root / name
    run.mkdir()
    rows = [{"step": 0, "val_loss": 9.0}]
    for step, (k0, k1, u0, u1) in diags.items():
        rows.append({"step": step, "diag/layer0/ffn.w_down/in_kurtosis": k0,
                     "diag/layer1/ffn.w_down/in_kurtosis": k1,
                     "diag/layer0/ffn.w_down/in_max_rms": k0 / 10,
                     "diag/layer1/ffn.w_down/in_max_rms": k1 / 10,
                     "diag/layer0/ffn.w_down/fp8_underflow": u0,
                     "diag/layer1/ffn.w_down/fp8_underflow": u1,
                     "diag/layer0/attn.wq/in_kurtosis": 1e6})
    rows.append({"step": 100, "val_loss": val_loss})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def runs(tmp_path):
    # step 40 is in the first half: ignored
    diags = {40: (1000.0, 1000.0, 0.5, 0.5), 60: (10.0, 30.0, 0.002, 0.001),
             100: (50.0, 20.0, 0.001, 0.004)}
    for seed, (base, base_fp8, uni, uni_fp8) in enumerate([(3.0, 3.1, 2.9, 3.2),
                                                           (3.2, 3.2, 3.0, 3.05)]):
        write_run(tmp_path, f"dense-l3-{BASE}-s{seed}", base, diags)
        write_run(tmp_path, f"dense-l3-{BASE}-model.fp8.tensorwise-s{seed}", base_fp8, diags)
        write_run(tmp_path, f"dense-l3-{UNIFIED}-s{seed}", uni, diags)
        write_run(tmp_path, f"dense-l3-{UNIFIED}-model.fp8.tensorwise-s{seed}", uni_fp8, diags)
    (tmp_path / "dense-l3-something-else-s0").mkdir()  # not an arm of the study
    return tmp_path


def test_penalties_pair_by_seed_and_outliers_take_the_late_largest_layer(runs):
    found = table.read_runs(runs)
    assert set(found) == {(arm, p, s) for arm in ("baseline", "unified")
                          for p in ("bf16", "tensorwise") for s in (0, 1)}
    late = found["unified", "tensorwise", 1]
    assert late["kurtosis"] == pytest.approx((30 + 50) / 2)
    assert late["max_rms"] == pytest.approx((3 + 5) / 2)
    assert late["flushed"] == pytest.approx((0.002 + 0.004) / 2)
    assert table.penalty(found, "unified", "tensorwise", 0) == pytest.approx(0.3)
    lines = table.against_baseline(found)
    (unified,) = [line for line in lines if line.startswith("| unified | tensorwise")]
    # seed 0: 0.3 - 0.1, seed 1: 0.05 - 0.0; the mean 0.125; unified's own penalty 0.175
    assert unified == "| unified | tensorwise | +0.2000 | +0.0500 | +0.1250 | +0.1750 |"
    rows = table.per_seed_table(found)
    assert "| baseline | bf16 | 0 | 3.0000 |  | 40 | 4.0 |  |" in rows
    assert "| baseline | tensorwise | 1 | 3.2000 | +0.0000 | 40 | 4.0 | 0.30% |" in rows


def test_an_empty_archive_names_the_study_command(tmp_path, capsys):
    with pytest.raises(SystemExit):
        table.main([str(tmp_path)])
    assert "bash scripts/run_study.sh fp8" in capsys.readouterr().err

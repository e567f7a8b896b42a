"""scripts/arm_report.py, the tables of the AdamW dense-l3 study, through its command line on run
directories written here: per-seed differences against the baseline, the share of unified's gap each
group closes, the final norm's scale from the last diagnostics record, each expectation worked out
by hand; and a group missing a seed is refused."""

from tests.support.helpers import REPO, load_script, run_main, run_script, write_run

FINAL = "diag/final_norm.sites.final/scale_rms"
UPDATE = "diag/final_norm.sites.final/scale_update_ratio"


def runs(root, name, terminal: dict[int, float],
         final_scale: dict[int, float] | None = None) -> str:
    """Runs <name>-s<seed> whose last val_loss is terminal[seed]; the prefix."""
    for seed, value in terminal.items():
        rows = [{"step": 10, "tokens": 100, "val_loss": value + 1.0},
                {"step": 20, "tokens": 200, "val_loss": value, "loss": value + 0.1}]
        if final_scale is not None:
            rows[1][FINAL] = final_scale[seed]
            rows[0][FINAL] = 9.0  # not the last record: ignored by the table
            rows[0][UPDATE], rows[1][UPDATE] = 1e-3 * (seed + 1), 2e-4
        write_run(root, f"{name}-s{seed}", {"seed": seed, "scale": {"name": name}}, rows)
    return str(root / name)


def test_differences_gap_shares_and_the_final_scale(tmp_path):
    base = runs(tmp_path, "base", {0: 3.0, 1: 3.2, 2: 2.9}, {0: 2.0, 1: 2.2, 2: 2.3})
    uni = runs(tmp_path, "uni", {0: 3.2, 1: 3.3, 2: 3.1}, {0: 0.8, 1: 0.9, 2: 1.0})
    # closes 0.15/0.2 = 0.75, 0.05/0.1 = 0.5, 0.2/0.2 = 1.0 of the gap: half or more on every seed
    half = runs(tmp_path, "half", {0: 3.05, 1: 3.25, 2: 2.9})
    # lower than the baseline on seed 0 only (share 1.5), worse than unified on seed 2 (share -0.5)
    mixed = runs(tmp_path, "mixed", {0: 2.9, 1: 3.25, 2: 3.2})
    out = tmp_path / "tables" / "l3.md"
    gap = tmp_path / "tables" / "l3_gap.md"
    done = run_script("arm_report.py", out, "--baseline", base, "--unified", uni, half, mixed,
                      "--over-training", gap)
    assert done.returncode == 0, done.stderr
    lines = out.read_text().splitlines()
    assert done.stdout == out.read_text() and len(lines) == 6
    assert lines[2] == ("| base | s0 3.0000, s1 3.2000, s2 2.9000 | s0 +0.0000, s1 +0.0000, s2 "
                        "+0.0000 | +0.0000 | 0/3 | s0 1.00, s1 1.00, s2 1.00 | yes | 2.167 |")
    assert lines[3] == ("| uni | s0 3.2000, s1 3.3000, s2 3.1000 | s0 +0.2000, s1 +0.1000, s2 "
                        "+0.2000 | +0.1667 | 0/3 | s0 0.00, s1 0.00, s2 0.00 | no | 0.900 |")
    assert lines[4] == ("| half | s0 3.0500, s1 3.2500, s2 2.9000 | s0 +0.0500, s1 +0.0500, s2 "
                        "+0.0000 | +0.0333 | 0/3 | s0 0.75, s1 0.50, s2 1.00 | yes | - |")
    assert lines[5] == ("| mixed | s0 2.9000, s1 3.2500, s2 3.2000 | s0 -0.1000, s1 +0.0500, s2 "
                        "+0.3000 | +0.0833 | 1/3 | s0 1.50, s1 0.50, s2 -0.50 | no | - |")
    # unified minus baseline at each evaluation (runs() puts each val_loss 1.0 higher at step 10)
    assert gap.read_text().splitlines() == ["| step | s0 | s1 | s2 | mean |",
                                            "|---:|---:|---:|---:|---:|",
                                            "| 10 | +0.2000 | +0.1000 | +0.2000 | +0.1667 |",
                                            "| 20 | +0.2000 | +0.1000 | +0.2000 | +0.1667 |", "",
                                            "| step | final norm scale, baseline | unified | "
                                            "update ratio, baseline | unified |",
                                            "|---:|---:|---:|---:|---:|",
                                            # the seeds' mean: (1 + 2 + 3)e-3 / 3
                                            "| 10 | 9.000 | 9.000 | 2.0e-03 | 2.0e-03 |",
                                            "| 20 | 2.167 | 0.900 | 2.0e-04 | 2.0e-04 |"]


def test_a_group_missing_a_seed_is_refused(tmp_path):
    base = runs(tmp_path, "base", {0: 3.0, 1: 3.2})
    uni = runs(tmp_path, "uni", {0: 3.2, 1: 3.3})
    short = runs(tmp_path, "short", {0: 3.1})
    # main() in this process: the test above runs the command itself
    done = run_main(load_script(REPO / "scripts" / "arm_report.py").main, tmp_path / "t.md",
                    "--baseline", base, "--unified", uni, short)
    assert done.returncode == 1 and "short lacks seed(s) [1] that the baseline has" in done.stderr


def test_runs_evaluated_at_other_steps_are_refused_over_training(tmp_path):
    base = runs(tmp_path, "base", {0: 3.0})
    write_run(tmp_path, "uni-s0", {"seed": 0}, [{"step": 15, "tokens": 150, "val_loss": 3.1}])
    done = run_main(load_script(REPO / "scripts" / "arm_report.py").main, tmp_path / "t.md",
                    "--baseline", base, "--unified", str(tmp_path / "uni"), "--over-training",
                    tmp_path / "gap.md")
    assert (done.returncode == 1
            and "evaluated at different steps ([10, 20] and [15])" in done.stderr)


def test_unified_below_the_baseline_closes_none_of_its_own_gap(tmp_path):
    """A seed where unified is lower: its own share is 0 (the division gives -0.0,
    written "-0.00")."""
    base = runs(tmp_path, "base", {0: 3.0})
    uni = runs(tmp_path, "uni", {0: 2.9})
    done = run_main(load_script(REPO / "scripts" / "arm_report.py").main, tmp_path / "t.md",
                    "--baseline", base, "--unified", uni)
    assert done.returncode == 0, done.stderr
    assert "| uni | s0 2.9000 | s0 -0.1000 | -0.1000 | 1/1 | s0 0.00 | no | - |" in done.stdout

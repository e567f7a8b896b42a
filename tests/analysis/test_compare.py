"""Run comparison on synthetic runs with known piecewise-linear loss curves, so that linear
interpolation in tokens is exact and every expected number follows in closed form."""

import csv
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from scalevec_analysis import (
    Run,
    ema,
    find_group,
    first_reach,
    fit_power_law,
    group_runs,
    load_run_dir,
    load_wandb,
    merge_records,
    metric_curve,
    parse_wandb_filter,
    run_from_history,
    scaling_series,
    summarize,
    write_comparison,
    write_scaling,
)
from scalevec_analysis.grouping import summary_markdown, write_summary_csv
from scalevec_train.infra.errors import ScalevecError
from tests.support.helpers import REPO, hide_package, load_script, run_main, run_script, write_run

# The plots need matplotlib (an optional package): the tests that write them skip without it.
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed (the analysis extra)")

TOKENS_PER_STEP = 50
VAL_EVERY = 5


def f_ref(t):
    """Reference validation loss: convex, piecewise linear, kinks at 500 and 1000 tokens
    (val points)."""
    return max(5 - 0.004 * t, 3.5 - 0.001 * t, 2.75 - 0.00025 * t)


def config(seed, scale="baseline", steps=40, lr=3e-3, dim=64):
    return {
        "seed": seed,
        "run_dir": f"/runs/{scale}-{steps}-{seed}",
        "resume": seed == 2,
        "model": {"name": "dense", "dim": dim, "n_layers": 2},
        "scale": {"name": scale, "heterogeneity": "branch" if scale == "unified" else "none",
                  "targets": ["q", "k", "o", "down"],
                  "weight_decay": "iwd" if scale == "unified" else "none"},
        "optim": {"name": "adamw", "lr": lr},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "train": {"steps": steps, "global_batch": 5, "seq_len": 10,
                  "profile_steps": [2] if seed % 2 else [],
                  "diagnostics_every": 10 if seed % 2 else 0},
        "data": {"name": "synthetic", "cache_dir": f"/tmp/c{seed}",
                 "tokenizer": f"/mnt/d{seed}/tok.model"},
        "logger": {"wandb": seed % 2 == 0, "log_every": 1},
        "checkpoint": {"every": 10, "dir": f"/ckpt/{seed}"},
    }


def metric_rows(curve, steps, offset, separate_val=True):
    """Train loss every step (curve + 0.1 + offset), val_loss every VAL_EVERY
    steps (curve + offset)."""
    rows = []
    for step in range(1, steps + 1):
        t = step * TOKENS_PER_STEP
        row = {"step": step, "loss": curve(t) + 0.1 + offset, "lr": 1e-3, "grad_norm": 1.0,
               "tokens": t, "tokens_per_s": 1e4, "scale/attn_mean": 1.0}
        val = {"step": step, "tokens": t, "val_loss": curve(t) + offset}
        if step % VAL_EVERY:
            rows.append(row)
        elif separate_val:
            rows += [row, val]
        else:
            rows.append({**row, **val})
    return rows


# name -> (curve, train.steps, val offsets of its seeds)
GROUPS = {
    "baseline": (f_ref, 40, (-0.01, 0.01)),
    "unified": (lambda t: f_ref(t) - 0.05, 40, (-0.02, 0.0, 0.02)),
    "unified-short": (lambda t: f_ref(t) - 0.05, 20, (-0.02, 0.0, 0.02)),
    "none": (lambda t: f_ref(t) + 0.3, 40, (-0.02, 0.0, 0.02)),
}


@pytest.fixture
def run_dirs(tmp_path):
    dirs = []
    for name, (curve, steps, offsets) in GROUPS.items():
        scale = name.split("-")[0]
        for seed, off in enumerate(offsets):
            rows = metric_rows(curve, steps, off, separate_val=seed % 2 == 0)
            if name == "unified" and seed == 1:
                # A crash after step 30 and a resume from the checkpoint at step 20: the first
                # attempt's steps 21..30 are garbage and must be replaced by the resumed
                # run's records.
                garbage = [{k: 9.0 if k in ("loss", "val_loss") else v for k, v in r.items()}
                           for r in rows if 20 < r["step"] <= 30]
                rows = ([r for r in rows if r["step"] <= 20] + garbage
                        + [r for r in rows if r["step"] > 20])
            dirs.append(write_run(tmp_path, f"{name}-{seed}", config(seed, scale, steps), rows))
    return dirs


def by_label(rows):
    return {r.label: r for r in rows}


def test_summary_reproduces_known_differences_and_efficiencies(run_dirs):
    groups = group_runs([load_run_dir(d) for d in run_dirs])
    # seed, run_dir, resume, data.cache_dir, logger.*, checkpoint.*, train.profile_*,
    # train.diagnostics_every and an absolute path differ per run.
    assert [(g.label, len(g.runs)) for g in groups] == [
        ("scale=baseline train.steps=40", 2), ("scale=unified train.steps=40", 3),
        ("scale=unified train.steps=20", 3), ("scale=none train.steps=40", 3)]
    rows = by_label(summarize(groups, find_group(groups, "scale=baseline"), "val_loss"))

    ref = rows["scale=baseline train.steps=40"]
    assert ref.is_reference and ref.terminal == pytest.approx(2.25, abs=1e-12)
    assert ref.std == pytest.approx(0.01 * math.sqrt(2), abs=1e-12)
    assert ref.delta == 0 and ref.efficiency == pytest.approx(1.0, abs=1e-12)

    better = rows["scale=unified train.steps=40"]
    assert better.delta == pytest.approx(-0.05, abs=1e-12)
    assert better.std == pytest.approx(0.02, abs=1e-12)
    assert better.reference_tokens is None and better.efficiency is None  # 2.2 < min of reference

    # unified after 1000 tokens: 2.45; the reference gets there at 2.75 - 0.00025 t = 2.45,
    # t = 1200, between its val points at 1000 and 1250 tokens.
    short = rows["scale=unified train.steps=20"]
    assert short.tokens == 1000 and short.delta == pytest.approx(0.2, abs=1e-12)
    assert short.reference_tokens == pytest.approx(1200, abs=1e-9)
    assert short.efficiency == pytest.approx(1.2, abs=1e-12)

    # none: 2.55, reached on the middle segment 3.5 - 0.001 t = 2.55 at t = 950; 950 / 2000 tokens.
    worse = rows["scale=none train.steps=40"]
    assert worse.delta == pytest.approx(0.3, abs=1e-12)
    assert worse.reference_tokens == pytest.approx(950, abs=1e-9)
    assert worse.efficiency == pytest.approx(0.475, abs=1e-12)


def test_train_loss_terminal_is_trailing_mean(run_dirs):
    groups = group_runs([load_run_dir(d) for d in run_dirs])
    k = 4
    rows = by_label(summarize(groups, find_group(groups, "scale=baseline train.steps=40"), "loss",
                              last_k=k))

    def trailing(curve, steps):
        values = [curve(s * TOKENS_PER_STEP) + 0.1 for s in range(1, steps + 1)]
        return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1])
                for i in range(steps)]

    ref_curve = trailing(f_ref, 40)
    short = rows["scale=unified train.steps=20"]
    target = trailing(GROUPS["unified-short"][0], 20)[-1]
    assert short.terminal == pytest.approx(target, abs=1e-12)
    assert short.delta == pytest.approx(target - ref_curve[-1], abs=1e-12)
    # first crossing of the reference's trailing-mean curve, by a plain scan
    i = next(i for i, v in enumerate(ref_curve) if v <= target)
    t0, t1 = i * TOKENS_PER_STEP, (i + 1) * TOKENS_PER_STEP
    expected = t0 + (ref_curve[i - 1] - target) / (ref_curve[i - 1] - ref_curve[i]) * (t1 - t0)
    assert short.reference_tokens == pytest.approx(expected, abs=1e-9)
    assert short.efficiency == pytest.approx(expected / 1000, abs=1e-12)


def test_first_reach_and_ema():
    tokens, values = np.array([10.0, 20.0, 40.0]), np.array([3.0, 2.0, 1.0])
    assert first_reach(tokens, values, 1.5) == 30.0
    assert first_reach(tokens, values, 2.0) == 20.0
    assert first_reach(tokens, values, 3.5) == 10.0  # already reached at the first point
    assert first_reach(tokens, values, 0.5) is None
    assert list(ema(np.array([0.0, 1.0, 1.0, 1.0]), 0.5)) == [0.0, 0.5, 0.75, 0.875]


def test_resume_keeps_last_record_per_step_and_merges_val_lines():
    rows = [{"step": s, "loss": 1.0, "tokens": s} for s in range(1, 11)]
    rows.append({"step": 10, "tokens": 10, "val_loss": 0.5})  # validation logged on its own line
    rows += [{"step": s, "loss": 2.0, "tokens": s} for s in range(6, 9)]  # resumed from step 5
    merged = merge_records(rows)
    assert [r["step"] for r in merged] == list(range(1, 9))  # 9, 10 belong to the abandoned attempt
    assert [r["loss"] for r in merged] == [1.0] * 5 + [2.0] * 3
    merged = merge_records(rows[:11])
    assert merged[-1] == {"step": 10, "loss": 1.0, "tokens": 10, "val_loss": 0.5}


def test_resumed_run_dir_reads_the_resumed_values(run_dirs):
    run = load_run_dir(next(d for d in run_dirs if d.name == "unified-1"))
    tokens, values = metric_curve(run, "val_loss")
    assert np.allclose(values, [f_ref(t) - 0.05 for t in tokens], rtol=0, atol=1e-12)
    assert run.records[-1]["step"] == 40


def test_a_partial_last_line_is_skipped_and_bad_lines_are_errors(tmp_path):
    rows = metric_rows(f_ref, 10, 0.0)
    d = write_run(tmp_path, "r", config(0), rows)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "loss"')
    assert load_run_dir(d).records[-1]["step"] == 10
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 2\n' + json.dumps(rows[0]) + "\n")
    with pytest.raises(ScalevecError, match="metrics.jsonl:1"):
        load_run_dir(d)


def test_grouping_splits_on_real_differences(tmp_path):
    runs = [load_run_dir(write_run(tmp_path, f"r{seed}-{lr}", config(seed, lr=lr),
                                   metric_rows(f_ref, 5, 0)))
            for seed in range(2) for lr in (1e-3, 3e-3)]
    groups = group_runs(runs)
    assert ([(g.label, len(g.runs)) for g in groups]
            == [("optim.lr=0.001", 2), ("optim.lr=0.003", 2)])
    assert find_group(groups, "optim.lr=3e-3") is groups[1]
    assert find_group(groups, "optim.lr=0.001") is groups[0]
    assert [g.label for g in group_runs(runs, ignore=["optim"])] == ["scale=baseline"]
    with pytest.raises(ScalevecError, match="matches 2 groups"):
        find_group(groups, "scale=baseline")
    with pytest.raises(ScalevecError, match="matches no group"):
        find_group(groups, "scale=unified")


def test_a_run_resumed_with_changes_on_purpose_is_a_group_of_its_own(tmp_path):
    """resumes.jsonl (scalevec_train/run/resume.py) of a run resumed with resume_changes=[optim.lr]
    sets it apart and names the change; operational changes alone (log cadence) do not."""
    rows = metric_rows(f_ref, 5, 0)
    runs = {name: write_run(tmp_path, name, config(seed), rows)
            for seed, name in enumerate(["plain", "cadence", "lr"])}
    entry = {"step": 3, "from": "x", "time": "t",
             "changes": {"train.log_every": {"from": 1, "to": 3, "kind": "operational"}}}
    (runs["cadence"] / "resumes.jsonl").write_text(json.dumps(entry) + "\n")
    lowered = {**entry, "changes": {**entry["changes"],
                                    "optim.lr": {"from": 0.003, "to": 0.001, "kind": "deliberate"}}}
    (runs["lr"] / "resumes.jsonl").write_text(json.dumps(entry) + "\n"
                                              + json.dumps({**lowered, "step": 4}) + "\n")
    groups = group_runs([load_run_dir(d) for d in runs.values()])
    assert sorted((g.label, sorted(Path(r.name).name for r in g.runs)) for g in groups) == [
        ("resumed_with=(unset)", ["cadence", "plain"]),
        ("resumed_with=optim.lr from step 4", ["lr"])]


def test_options_added_later_take_their_default(tmp_path):
    """A run written before `init_from` existed groups with one that leaves it at its default ("");
    a run that sets it, to a relative or an absolute path, is a group of its own."""
    rows = metric_rows(f_ref, 5, 0)
    configs = {"older": config(0), "newer": {**config(1), "init_from": ""},
               "relative": {**config(2), "init_from": "models/llama"},
               "absolute": {**config(3), "init_from": "/ckpt/llama"}}
    runs = [load_run_dir(write_run(tmp_path, name, cfg, rows)) for name, cfg in configs.items()]
    groups = group_runs(runs)
    assert sorted((g.label, sorted(Path(r.name).name for r in g.runs)) for g in groups) == [
        ("init_from=", ["newer", "older"]), ("init_from=/ckpt/llama", ["absolute"]),
        ("init_from=models/llama", ["relative"])]


def test_task_metrics_join_the_summary(tmp_path):
    """Runs that scored a downstream task: the summary shows each group's final accuracies (mean
    over its seeds; the last logged value of each run) and the CSV every task metric; the task
    settings (tasks.*) do not split groups. A group without the task shows n/a."""
    dirs = []
    for scale, accs in (("baseline", (0.30, 0.40)), ("unified", (0.50, 0.60)), ("none", ())):
        for seed in range(max(len(accs), 1)):
            rows = metric_rows(f_ref, 10, 0)
            if accs:
                task = {"task/nl/acc": accs[seed], "task/nl/acc_norm": accs[seed] / 2,
                        "task/nl/bpb": 1.5, "task/nl/chance": 0.25}
                rows = [{"step": 0, "tokens": 0, **{k: 0.0 for k in task}, "task/nl/chance": 0.25},
                        *rows, {"step": 10, "tokens": 10 * TOKENS_PER_STEP, **task}]
            cfg = {**config(seed, scale, 10),
                   "tasks": {"every": seed, "items": [{"name": "nl"}] if accs else []}}
            dirs.append(write_run(tmp_path, f"{scale}-{seed}", cfg, rows))
    groups = group_runs([load_run_dir(d) for d in dirs])
    rows = summarize(groups, groups[0])
    assert ([(r.label, r.runs) for r in rows]
            == [("scale=baseline", 2), ("scale=unified", 2), ("scale=none", 1)])
    assert rows[0].tasks == pytest.approx({"task/nl/acc": 0.35, "task/nl/acc_norm": 0.175,
                                           "task/nl/bpb": 1.5, "task/nl/chance": 0.25})
    assert rows[2].tasks == {}
    table = summary_markdown(rows, "val_loss")
    assert table.splitlines()[0].endswith("| nl acc (chance 0.25) | nl acc_norm (chance 0.25) |")
    assert (table.splitlines()[3].endswith("| 0.550 | 0.275 |")
            and table.splitlines()[4].endswith("| n/a | n/a |"))
    write_summary_csv(rows, tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert (float(csv_rows[1]["task/nl/acc"]) == pytest.approx(0.55)
            and csv_rows[2]["task/nl/bpb"] == "")


def test_missing_val_loss_is_a_clear_error(tmp_path):
    rows = [r for r in metric_rows(f_ref, 10, 0) if "loss" in r]
    run = load_run_dir(write_run(tmp_path, "r", config(0), rows))
    with pytest.raises(ScalevecError, match="no `val_loss` values logged"):
        metric_curve(run, "val_loss")


@needs_matplotlib
def test_write_comparison_files_and_png(run_dirs, tmp_path):
    from matplotlib.image import imread

    out = tmp_path / "out"
    table = write_comparison([load_run_dir(d) for d in run_dirs], "scale=baseline", out,
                             ema_beta=0.9, logx=True, logy=True)
    assert (out / "summary.md").read_text() == table
    assert ("| scale=unified train.steps=40 | 3 | 2000 | 2.2000 | 0.0200 | -0.0500 | not reached |"
            in table)
    with open(out / "summary.csv") as f:
        rows = {r["group"]: r for r in csv.DictReader(f)}
    assert (float(rows["scale=none train.steps=40"]["token_efficiency"])
            == pytest.approx(0.475, abs=1e-12))
    assert rows["scale=unified train.steps=40"]["token_efficiency"] == "not reached"
    png = out / "curves.png"
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the groups' curves are drawn: the first group's colour (C0, #1f77b4) covers many pixels
    pixels = (imread(png)[..., :3] * 255).round()
    assert np.sum(np.all(np.abs(pixels - [31, 119, 180]) < 8, axis=-1)) > 200


def test_run_from_history_matches_run_dir(tmp_path):
    cfg, rows = config(3), metric_rows(f_ref, 10, 0.0)
    from_dir = load_run_dir(write_run(tmp_path, "r", cfg, rows, params=1234))
    history = [{"_step": r["step"], "_runtime": 1.5, "loss": r.get("loss"),
                "val_loss": r.get("val_loss"),
                **{k: v for k, v in r.items() if k not in ("step", "loss", "val_loss")}}
               for r in rows]
    wandb_config = ({k: {"value": v, "desc": None} for k, v in cfg.items()}
                    | {"_wandb": {"cli_version": "x"}})
    from_wandb = run_from_history("e/p/abc", history, wandb_config, params=1234)
    assert from_wandb.config == from_dir.config
    assert [{k: v for k, v in r.items() if k not in ("_step", "_runtime")}
            for r in from_wandb.records] == \
        from_dir.records
    assert from_wandb.params == from_dir.params == 1234
    assert len(group_runs([from_dir, from_wandb])) == 1


def test_parse_wandb_filter():
    assert parse_wandb_filter('me/proj:{"config.scale.name": "unified"}') == \
        ("me/proj", {"config.scale.name": "unified"})
    assert parse_wandb_filter("me/proj") == ("me/proj", None)
    with pytest.raises(ScalevecError, match="not JSON"):
        parse_wandb_filter("me/proj:{bad")
    with pytest.raises(ScalevecError, match="ENTITY/PROJECT"):
        parse_wandb_filter("proj:{}")


def test_wandb_missing_is_a_clear_error(monkeypatch):
    hide_package(monkeypatch, "wandb")
    with pytest.raises(ScalevecError, match="wandb is not installed"):
        load_wandb(["e/p/abc"])


def test_matplotlib_missing_is_a_clear_error(run_dirs, tmp_path, monkeypatch):
    hide_package(monkeypatch, "matplotlib")
    with pytest.raises(ScalevecError, match="plots need matplotlib"):
        write_comparison([load_run_dir(d) for d in run_dirs], "scale=baseline", tmp_path / "out")


def test_fit_power_law_recovers_exact_parameters():
    n = np.array([2e5, 1e6, 5e6, 2.5e7, 1.25e8])
    for e, a, alpha in [(1.7, 400.0, 0.3137), (2.1, 12.0, 0.0812), (0.5, 3e4, 1.1043)]:
        fit = fit_power_law(n, e + a * n ** -alpha)
        assert (fit.E, fit.A, fit.alpha) == pytest.approx((e, a, alpha), rel=1e-6)
        assert fit.rmse < 1e-9
    with pytest.raises(ScalevecError, match="at least 3"):
        fit_power_law([1e6, 1e7, 1e7], [3.0, 2.9, 2.9])


SCALING = {"baseline": (1.8, 400.0, 0.3512), "unified": (1.75, 380.0, 0.3571)}
SIZES = {32: 1e6, 64: 4e6, 128: 1.6e7, 256: 6.4e7, 512: 2.56e8}


def scaling_dirs(root):
    dirs = []
    for scale, (e, a, alpha) in SCALING.items():
        for dim, n in SIZES.items():
            for seed, off in enumerate((-0.01, 0.01)):
                loss = e + a * n ** -alpha
                rows = metric_rows(lambda t, loss=loss: loss + 1e-4 * (40 * TOKENS_PER_STEP - t),
                                   40, off)
                dirs.append(write_run(root, f"{scale}-{dim}-{seed}", config(seed, scale, dim=dim),
                                      rows, n))
    return dirs


def test_scaling_fit_per_strategy(tmp_path):
    series = scaling_series([load_run_dir(d) for d in scaling_dirs(tmp_path)])
    assert [s.label for s in series] == ["scale=baseline", "scale=unified"]
    for s, (e, a, alpha) in zip(series, SCALING.values(), strict=True):
        assert list(s.sizes) == sorted(SIZES.values()) and list(s.counts) == [2] * 5
        assert (s.fit.E, s.fit.A, s.fit.alpha) == pytest.approx((e, a, alpha), rel=1e-6)


def test_scaling_errors(tmp_path):
    runs = [load_run_dir(d) for d in scaling_dirs(tmp_path)]
    twin = write_run(tmp_path, "twin", config(5, "baseline", dim=32, lr=1e-2),
                     metric_rows(f_ref, 5, 0), 1e6)
    with pytest.raises(ScalevecError, match="differ in more than the seed: optim.lr"):
        scaling_series([*runs, load_run_dir(twin)])
    bare = write_run(tmp_path, "bare", config(0), metric_rows(f_ref, 5, 0))
    with pytest.raises(ScalevecError, match="no parameter count"):
        scaling_series([load_run_dir(bare)])
    few = [r for r in runs if r.params < 5e6 or r.config["scale.name"] == "unified"]
    series = scaling_series(few)
    assert series[0].fit is None and series[1].fit is not None


@needs_matplotlib
def test_write_scaling_files(tmp_path):
    out = tmp_path / "out"
    table = write_scaling([load_run_dir(d) for d in scaling_dirs(tmp_path)], out)
    assert "| scale=baseline | 5 | 10 | 1.8000 | 400 | 0.3512 |" in table
    assert (out / "scaling.png").stat().st_size > 0
    with open(out / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[1]["alpha"]) == pytest.approx(0.3571, rel=1e-6)


def cli(*args):
    """compare_runs.py's main in this process (test_cli runs the command itself once)."""
    return run_main(load_script(REPO / "scripts" / "compare_runs.py").main, *args)


@needs_matplotlib
def test_cli(run_dirs, tmp_path):
    out = tmp_path / "cli"
    done = run_script("compare_runs.py", *run_dirs, "--reference", "scale=baseline", "--out", out,
                      "--metric", "val_loss", "--ema", "0.5")
    assert done.returncode == 0, done.stderr
    assert "scale=baseline train.steps=40 (ref)" in done.stdout and "| 0.475 |" in done.stdout
    assert all((out / f).stat().st_size > 0 for f in ("curves.png", "summary.md", "summary.csv"))
    bad = cli(*run_dirs, "--reference", "scale=nope", "--out", out)
    assert bad.returncode == 1 and "--reference: 'scale=nope' matches no group" in bad.stderr
    (tmp_path / "sizes").mkdir()
    scaling = cli(*scaling_dirs(tmp_path / "sizes"), "--scaling", "--out", out)
    assert scaling.returncode == 0, scaling.stderr
    assert "scale=unified" in scaling.stdout and (out / "scaling.png").stat().st_size > 0


def test_run_needs_tokens():
    run = Run("r", {}, [{"step": 1, "val_loss": 2.0}])
    with pytest.raises(ScalevecError, match="no `tokens`"):
        metric_curve(run, "val_loss")


@needs_matplotlib
def test_a_mixture_source_loss_is_a_metric(tmp_path):
    """--metric val_loss/NAME: the terminal loss is that source's (here 1.0 above the mixture's
    val_loss), and the curve figure gets its panel; a metric of no source is refused."""
    dirs = []
    for scale, offset in (("baseline", 0.0), ("unified", -0.05)):
        for seed in (0, 1):
            rows = [{**r, "val_loss/docs": r["val_loss"] + 1.0} if "val_loss" in r else r
                    for r in metric_rows(f_ref, 20, offset)]
            dirs.append(write_run(tmp_path, f"{scale}-{seed}", config(seed, scale, steps=20), rows))
    mixture = cli(*dirs, "--reference", "scale=baseline", "--out", tmp_path / "docs", "--metric",
                  "val_loss/docs")
    plain = cli(*dirs, "--reference", "scale=baseline", "--out", tmp_path / "mix", "--metric",
                "val_loss")
    assert mixture.returncode == plain.returncode == 0, mixture.stderr + plain.stderr
    def terminal(out):
        return {d["group"]: float(d["terminal_mean"])
                for d in csv.DictReader((tmp_path / out / "summary.csv").open())}

    assert (terminal("docs")
            == pytest.approx({g: v + 1.0 for g, v in terminal("mix").items()}, abs=1e-9))
    assert "terminal val_loss/docs" in mixture.stdout
    for bad in ("val_loss/", "docs", "loss/docs"):
        done = cli(*dirs, "--reference", "scale=baseline", "--out", tmp_path / "bad", "--metric",
                   bad)
        assert done.returncode == 2 and "val_loss/NAME" in done.stderr, done.stderr
    missing = cli(*dirs, "--reference", "scale=baseline", "--out", tmp_path / "bad", "--metric",
                  "val_loss/code")
    assert missing.returncode == 1 and "no `val_loss/code` values logged" in missing.stderr


def test_mixture_entries_group_and_label_by_field(tmp_path):
    """data.mixture (a list of sections) flattens by index: runs that differ in one source's weight
    form groups labelled by that field, and each source's path is ignored like data.path."""
    dirs = []
    for weight, seed in ((0.25, 0), (0.25, 1), (0.5, 0)):
        cfg = config(seed)
        cfg["data"]["mixture"] = [{"name": "code", "source": "stdlib", "path": "", "weight": 0.75},
                                  {"name": "docs", "source": "text_dir",
                                   "path": f"/home/u{seed}/docs", "weight": weight}]
        dirs.append(write_run(tmp_path, f"w{weight}-{seed}", cfg, metric_rows(f_ref, 5, 0)))
    groups = group_runs([load_run_dir(d) for d in dirs])
    assert sorted((g.label, len(g.runs)) for g in groups) == [("data.mixture.1.weight=0.25", 2),
                                                              ("data.mixture.1.weight=0.5", 1)]

"""scripts/ladder_report.py, the ladder study's own tables, through its command line on run
directories written here: the LR picks run_study.sh feeds to the ladder, and the terminal table's
means, standard deviations and per-seed differences, each expectation worked out by hand."""

from tests.support.helpers import REPO, load_script, run_main, run_script, write_run


def ladder_run(root, name, *, scale, optim, lr=0.01, seed=0, tpp=10.0, val=(4.0, 3.0),
               bpb=(2.0, 1.5), task=None):
    """A run directory with two evaluations (the last is terminal); with `task`, the next_line.txt
    the evaluate command writes."""
    cfg = {"seed": seed, "scale": {"name": scale}, "optim": {"name": optim, "lr": lr},
           "model": {"name": "dense-l1", "dim": 64}, "train": {"tokens_per_param": tpp}}
    rows = [{"step": 0, "tokens": 0, "val_loss": 9.0, "val_bpb": 5.0},
            {"step": 10, "tokens": 5120, "loss": val[0] + 0.1, "val_loss": val[0],
             "val_bpb": bpb[0]},
            {"step": 20, "tokens": 10240, "loss": val[1] + 0.1, "val_loss": val[1],
             "val_bpb": bpb[1]},
            {"step": 20, "tokens": 10240, "tokens_per_s": 1000.0}]
    d = write_run(root, name, cfg, rows)
    if task is not None:
        (d / "next_line.txt").write_text(f"checkpoint step 20\ntask/next_line/acc {task}\n"
                                         "task/next_line/chance 0.25\n")
    return d


def report(*args, command: bool = False):
    """The script's output: with `command`, run as a command; else its main in this process (a child
    Python costs seconds, and one test running the command covers it)."""
    script = "ladder_report.py"
    done = (run_script(script, *args) if command
            else run_main(load_script(REPO / "scripts" / script).main, *args))
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_lr_grid_picks_each_arms_lowest_terminal_loss_and_the_lower_lr_on_a_tie(tmp_path):
    # baseline adamw: 3e-3 is best although 1e-3 is lower at step 10; unified muon: 1e-3 and
    # 1e-2 tie
    terminal = {("baseline", "adamw"): {0.001: 3.30, 0.003: 3.10, 0.01: 3.20},
                ("unified", "muon"): {0.001: 3.05, 0.003: 3.15, 0.01: 3.05}}
    runs = [ladder_run(tmp_path, f"{scale}-{optim}-{lr}", scale=scale, optim=optim, lr=lr,
                       val=(v - 0.5, v))
            for (scale, optim), grid in terminal.items() for lr, v in grid.items()]
    out = tmp_path / "grid" / "lr_grid.md"
    assert report("lr", out, *runs, command=True) == "baseline adamw 0.003\nunified muon 0.001\n"
    assert out.read_text() == (
        "| arm | lr 0.001 | lr 0.003 | lr 0.01 | best |\n"
        "|---|---:|---:|---:|---:|\n"
        "| baseline adamw | 3.3000 | **3.1000** | 3.2000 | 0.003 |\n"
        "| unified muon | **3.0500** | 3.1500 | 3.0500 | 0.001 |\n")


def test_terminal_table_pairs_seeds_and_orders_budgets_as_numbers(tmp_path):
    runs = []
    # tokens/param 10: baseline seeds 0, 1; unified seeds 0, 1, 2 (seed 2 has no pair); the task
    # scored, where higher is better
    for seed, v, b, acc in ((0, 3.0, 1.0, 0.50), (1, 3.2, 1.2, 0.60)):
        runs.append(ladder_run(tmp_path, f"b{seed}", scale="baseline", optim="adamw", seed=seed,
                               val=(4, v), bpb=(2, b), task=acc))
    for seed, v, b, acc in ((0, 2.8, 0.9, 0.55), (1, 3.3, 1.25, 0.65), (2, 3.1, 1.0, 0.70)):
        runs.append(ladder_run(tmp_path, f"u{seed}", scale="unified", optim="adamw", seed=seed,
                               val=(4, v), bpb=(2, b), task=acc))
    # tokens/param 2.5, one seed each, not scored: no task row, no standard deviation
    runs.append(ladder_run(tmp_path, "b-short", scale="baseline", optim="adamw", tpp=2.5,
                           val=(4, 3.5)))
    runs.append(ladder_run(tmp_path, "u-short", scale="unified", optim="adamw", tpp=2.5,
                           val=(4, 3.6)))
    out = tmp_path / "terminal.md"
    table = report("table", out, *runs)
    assert table == out.read_text()
    # unified val_loss 2.8, 3.3, 3.1: mean 3.0667, sample sd sqrt(0.12667 / 2) = 0.2517
    assert table.splitlines()[2:] == [
        "| adamw | dense-l1 | 2.5 | val_loss | 3.5000 ± nan | 3.6000 ± nan | s0 +0.1000 | "
        "+0.1000 | 0/1 |",
        "| adamw | dense-l1 | 2.5 | val_bpb | 1.5000 ± nan | 1.5000 ± nan | s0 +0.0000 | "
        "+0.0000 | 0/1 |",
        "| adamw | dense-l1 | 10 | val_loss | 3.1000 ± 0.1414 | 3.0667 ± 0.2517 | s0 -0.2000, "
        "s1 +0.1000 | -0.0500 | 1/2 |",
        "| adamw | dense-l1 | 10 | val_bpb | 1.1000 ± 0.1414 | 1.0500 ± 0.1803 | s0 -0.1000, "
        "s1 +0.0500 | -0.0250 | 1/2 |",
        "| adamw | dense-l1 | 10 | task/next_line/acc | 0.5500 ± 0.0707 | 0.6333 ± 0.0764 "
        "| s0 +0.0500, s1 +0.0500 | +0.0500 | 2/2 |",
    ]

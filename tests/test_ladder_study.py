"""The ladder study's design (scripts/run_study.sh ladder, configs/experiment/ladder.yaml) holds for
every rung as the script composes it: the budgets in tokens per parameter, a checkpoint for each
branch to start from before its decay, the same validation sequences on every rung, and a run
directory per run; the adamw_l3 and fp8 studies' arms compose and are named by every key they
vary."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from scalevec_train.costs.accounting import non_embedding_params
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.fp8 import map_precisions
from scalevec_train.run.branch import shared_steps
from tests.support.helpers import make_config_shared, make_configs

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run_study.sh"
# dense-l4 and up, and the MoE twins, for the scaling study (scripts/lr_grid.py's SCALING parts)
RUNGS = ["dense-l1", "dense-l2", "dense-l3", "dense-l4", "dense-l6", "moe-l2", "moe-l3", "moe-l4"]


def rung_overrides() -> dict[str, list[str]]:
    """{rung: its overrides} from the script's rung_args."""
    found = re.findall(r"^\s*((?:dense|moe)-l\d(?:\|moe-l\d)?)\) echo (.*?) ;;$",
                       SCRIPT.read_text(), flags=re.M)
    return {rung: args.split() for rungs, args in found for rung in rungs.split("|")}


def ladder_overrides(rung: str, *extra: str) -> list[str]:
    return ["+experiment=ladder", f"model={rung}", *rung_overrides()[rung], *extra]


def ladder_config(rung: str, *extra: str):
    return make_config_shared(*ladder_overrides(rung, *extra))


def test_the_script_names_every_rung():
    assert sorted(rung_overrides()) == RUNGS


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("scale", ["baseline", "unified"])
def test_budgets_branch_points_and_validation_set(rung, scale):
    trunk = ladder_config(rung, f"scale={scale}")
    n = non_embedding_params(Transformer(trunk.model, trunk.scale))
    tokens_per_step = trunk.train.global_batch * trunk.train.seq_len
    assert trunk.train.steps * tokens_per_step == pytest.approx(10 * n, rel=0.01)
    # every rung validates on the same 128 sequences of 128 tokens
    assert trunk.train.eval_batches * trunk.train.global_batch == 128 and trunk.train.seq_len == 128
    assert trunk.train.steps / trunk.train.eval_every == pytest.approx(20, abs=1.5)
    for budget in (2.5, 5):
        branch = ladder_config(rung, f"scale={scale}", f"train.tokens_per_param={budget}")
        assert branch.train.steps * tokens_per_step == pytest.approx(budget * n, rel=0.02)
        # WSD decays over the last 20%: the branch starts from the trunk's newest checkpoint before
        # that, at 2 and 4 tokens per parameter, only a few steps before its decay
        decay_start = shared_steps(trunk, branch, branch.train.steps)
        start = decay_start // trunk.checkpoint.every * trunk.checkpoint.every
        assert start * tokens_per_step == pytest.approx(0.8 * budget * n, rel=0.02)
        assert decay_start - start < 0.05 * branch.train.steps


def test_every_run_has_its_own_directory():
    # the runs of one rung, scale and optimizer share a compose (make_configs)
    dirs = {cfg.run_dir for cfg in make_configs(
        ladder_overrides(rung, f"scale={scale}", f"optim={optim}", f"optim.lr={lr}", f"seed={seed}",
                         *([] if tpp is None else [f"train.tokens_per_param={tpp}"]))
        for rung in ("dense-l1", "dense-l3")
        for scale in ("baseline", "unified") for optim in ("adamw", "muon")
        for lr in (0.003, 0.01) for seed in (0, 1) for tpp in (None, 2.5, 5))}
    assert len(dirs) == 2 * 2 * 2 * 2 * 2 * 3
    assert all(d.startswith("runs/ladder/") for d in dirs)


def study_arms() -> dict[str, list[str]]:
    """{name: overrides} of the adamw_l3 study's arms, from the script."""
    block = re.search(r"<<'ARMS'\n(.*?)\nARMS\n", SCRIPT.read_text(), flags=re.S).group(1)
    return {name: args.split() for name, args in (line.split("|") for line in block.splitlines())}


def name_of(overrides: list[str]) -> str:
    """The run name the study's convention gives these overrides, written out here: scale, optimizer
    and LR, then every other key the arm sets, in order."""
    values = dict(o.split("=", 1) for o in overrides)
    short = {"optim.scale_lr": "scale_lr", "optim.adamw_lr": "adamw_lr",
             "optim.scale_weight_decay": "scale_wd"}
    parts = [values.pop("scale"), values.pop("optim"), "lr" + values.pop("optim.lr")]
    for key, value in values.items():
        if key in short:
            parts.append(short[key] + value)
        else:
            parts.append(key.removeprefix("scale.") + "." + value.strip("[]").replace(",", "."))
    return "-".join(parts)


def test_the_adamw_l3_study_names_every_key_its_arms_vary_and_every_arm_composes():
    arms = study_arms()
    assert len(arms) == 19
    for name, overrides in arms.items():
        assert name == name_of(overrides)
        cfg = ladder_config("dense-l3", *overrides, "train.diagnostics_every=180", "seed=0")
        assert cfg.train.steps // cfg.train.diagnostics_every >= 9  # the sites over time, not once


def ladder_commands(tmp_path: Path, *args: str, **env: str) -> list[list[str]]:
    """The overrides of each training command the script's ladder_run starts for `args` (its own
    bash function, run with PY standing for a program that records its arguments)."""
    text = SCRIPT.read_text()
    functions = "".join(re.search(rf"^{name}\(\) {{.*?^}}\n", text, flags=re.S | re.M).group(0)
                        for name in ("rung_args", "ladder_run"))
    tmp_path.mkdir()
    record = tmp_path / "record"
    record.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "commands"}\n')
    record.chmod(0o755)
    subprocess.run(["bash", "-c", f"{functions}ladder_run {' '.join(args)}"], cwd=tmp_path,
                   check=True, env={**os.environ, "PY": str(record), **env})
    lines = (tmp_path / "commands").read_text().splitlines()
    assert all(line.startswith("-m scalevec_train.train ") for line in lines)
    return [line.split()[2:] for line in lines]


def test_ladder_runs_go_where_the_experiment_puts_them_and_a_variant_to_a_folder_of_its_own(
        tmp_path):
    """A trunk and its two branches: by default in runs/ladder/ as configs/experiment/ladder.yaml
    names them; with LADDER and LADDER_ARGS (the adamw_l3 study's ladder at optim.scale_lr=0.01), in
    that folder under the same names, every run with the override, each branch from its own
    trunk."""
    default = ladder_commands(tmp_path / "default", "dense-l1", "unified", "adamw", "0.01", "1")
    names = ["dense-l1-unified-adamw-lr0.01-tpp10.0-s1", "dense-l1-unified-adamw-lr0.01-tpp2.5-s1",
             "dense-l1-unified-adamw-lr0.01-tpp5.0-s1"]
    for command, name in zip(default, names, strict=True):
        run_dir = [o for o in command if o.startswith("run_dir=")]
        assert run_dir == [f"run_dir=runs/ladder/{name}"]
        others = [o for o in command if not o.startswith("run_dir=")]
        assert make_config_shared(*others).run_dir == f"runs/ladder/{name}"
    variant = ladder_commands(tmp_path / "variant", "dense-l1", "unified", "adamw", "0.01", "1",
                              LADDER="runs/adamw_l3/ladder_scale_lr0.01",
                              LADDER_ARGS="optim.scale_lr=0.01")
    assert len(variant) == 3
    for command, name in zip(variant, names, strict=True):
        cfg = make_config_shared(*command)
        assert (cfg.run_dir == f"runs/adamw_l3/ladder_scale_lr0.01/{name}"
                and cfg.optim.scale_lr == 0.01)
    assert all(f"branch_from=runs/adamw_l3/ladder_scale_lr0.01/{names[0]}" in c
               for c in variant[1:])


def script_functions(*names: str) -> str:
    """The shell functions `names` as the script defines them, to run on their own."""
    text = SCRIPT.read_text()
    return "".join(re.search(rf"^{name}\(\) {{.*?^}}\n", text, flags=re.S | re.M).group(0)
                   for name in names)


def fp8_study_arms() -> dict[str, list[str]]:
    """{name: overrides} of the fp8 study's arms, from the script."""
    block = re.search(r"<<'FP8ARMS'\n(.*?)\nFP8ARMS\n", SCRIPT.read_text(), flags=re.S).group(1)
    return {name: args.split() for name, args in (line.split("|") for line in block.splitlines())}


def test_the_fp8_study_names_every_key_its_arms_vary_and_runs_every_map_in_fp8(tmp_path):
    """15 arms: baseline, unified and unified's 3 ablations, each in bf16 and under tensorwise and
    rowwise; every FP8 arm converts all 21 block maps of dense-l3; arm_run puts each run in
    runs/fp8/."""
    arms = fp8_study_arms()
    assert len(arms) == 15
    precisions: dict[str, set[str]] = {}
    for name, overrides in arms.items():
        assert name == name_of(overrides)
        cfg = ladder_config("dense-l3", "model.fp8_filter=all", *overrides,
                            "train.diagnostics_every=180", "seed=0")
        assert cfg.train.steps // cfg.train.diagnostics_every >= 9
        assert (cfg.optim.lr, cfg.optim.scale_lr) == (0.003, 0.01)
        with torch.device("meta"):
            rows = map_precisions(Transformer(cfg.model, cfg.scale))
        assert sum(r.fp8 for r in rows) == (0 if cfg.model.fp8 == "none" else 3 * 7), name
        strategy = " ".join(o for o in overrides if not o.startswith("model.fp8="))
        precisions.setdefault(strategy, set()).add(cfg.model.fp8)
    assert len(precisions) == 5 and all(p == {"none", "tensorwise", "rowwise"}
                                        for p in precisions.values())
    functions = script_functions("rung_args", "diag_every", "arm_run")
    record = tmp_path / "record"
    record.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "commands"}\n')
    record.chmod(0o755)
    (tmp_path / "runs" / "fp8_logs").mkdir(parents=True)
    name, overrides = "unified-adamw-lr0.003-scale_lr0.01-model.fp8.rowwise", arms[
        "unified-adamw-lr0.003-scale_lr0.01-model.fp8.rowwise"]
    subprocess.run(["bash", "-c", f"{functions}arm_run dense-l3 {name} 2 model.fp8_filter=all "
                                  f"{' '.join(overrides)}"],
                   cwd=tmp_path, check=True,
                   env={**os.environ, "PY": str(record), "ARMS": "runs/fp8"})
    [command] = (tmp_path / "commands").read_text().splitlines()
    cfg = make_config_shared(*command.split()[2:])
    assert (cfg.run_dir == f"runs/fp8/dense-l3-{name}-s2" and cfg.model.fp8 == "rowwise"
            and cfg.seed == 2)
    assert cfg.model.fp8_filter == "all" and cfg.train.diagnostics_every == 180


def test_the_fp8_study_keeps_each_finished_or_diverged_run_and_skips_what_it_kept(tmp_path):
    """With ARMS_ARCHIVE set, arm_run archives a run that finished (its records, no checkpoints)
    or diverged (exit status 3: a note), trains neither again from a fresh root, and stops on any
    other failure."""
    functions = script_functions("rung_args", "diag_every", "arm_run")
    # PY stands in for training (a finished run of 4 steps, or the exit status in $tmp/rc) and runs
    # the real scripts/lr_grid.py
    fake = tmp_path / "py"
    fake.write_text(f"""#!/bin/bash
if [ "$1" = -m ]; then
  echo "$@" >> {tmp_path}/commands
  rc=$(cat {tmp_path}/rc); [ "$rc" = 0 ] || exit $rc
  d=${{@: -1}}; d=${{d#run_dir=}}
  mkdir -p $d/checkpoints/step_000004 && touch $d/checkpoints/step_000004/COMPLETE
  printf 'train:\\n  steps: 4\\n' > $d/config.yaml
  echo '{{"step": 4, "val_loss": 2.5}}' > $d/metrics.jsonl
  exit 0
fi
exec {SCRIPT.parents[1] / ".venv/bin/python"} "$@"
""")
    fake.chmod(0o755)
    (tmp_path / "scripts").symlink_to(SCRIPT.parent)
    env = {**os.environ, "PY": str(fake), "ARMS": "runs/fp8", "ARMS_ARCHIVE": "kept"}

    def arm(name: str, rc: int) -> int:
        (tmp_path / "rc").write_text(str(rc))
        (tmp_path / "runs" / "fp8_logs").mkdir(parents=True, exist_ok=True)
        return subprocess.run(["bash", "-c", f"{functions}arm_run dense-l3 {name} 0"],
                              cwd=tmp_path, env=env, capture_output=True, text=True).returncode

    def trained() -> int:
        path = tmp_path / "commands"
        return len(path.read_text().splitlines()) if path.exists() else 0

    assert arm("a", 0) == 0 and trained() == 1
    kept = tmp_path / "kept" / "dense-l3-a-s0"
    assert sorted(p.name for p in kept.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert arm("b", 3) == 0 and (tmp_path / "kept" / "dense-l3-b-s0.failed").is_file()
    assert arm("c", 1) == 1 and not (tmp_path / "kept" / "dense-l3-c-s0").exists()
    assert trained() == 3
    shutil.rmtree(tmp_path / "runs")  # a fresh clone: only the archive is left
    assert arm("a", 0) == 0 and arm("b", 0) == 0 and trained() == 3
    assert arm("c", 0) == 0 and trained() == 4

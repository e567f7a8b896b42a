"""The bit-for-bit matrix: what a redesign that must not change training runs before and after
itself.

    python dev/bit_matrix.py record DIR     # the code as it is: every case's runs, into DIR
    python dev/bit_matrix.py check DIR      # the code as it is now, against what DIR recorded

Cases: dense-tiny and moe-tiny x baseline and unified x AdamW and Muon x 1 and 2 ranks (gloo on the
CPU, torchrun): each a run of 12 steps with a checkpoint at step 6, and a second run resumed from
that checkpoint. `record` keeps each case's step-6 checkpoint and the per-step losses, gradient
norms and validation losses of both runs in DIR/results.json, and checks that the resumed run
repeats the full one from step 7. `check` runs every case again and resumes from the recorded
checkpoints (written by the old code), and compares every number with the recording by float
equality; it exits 1 naming each case and step that differ. `--cases` picks cases by shell pattern
(e.g. 'dense-unified-adamw-*').
"""

import argparse
import fnmatch
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

from scalevec_train.training.logger import read_records  # noqa: E402  (the checkout's own package)

MODELS = {"dense": "dense-tiny", "moe": "moe-tiny"}
SCALES, OPTIMS, RANKS = ("baseline", "unified"), ("adamw", "muon"), (1, 2)
STEPS, CHECKPOINT_STEP = 12, 6
# Small and fast: a narrow model, short sequences, an evaluation every 3 steps, a log line every
# step.
COMMON = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
          "model.ffn_dim=128", "model.vocab_size=512", "train.seq_len=64", "train.global_batch=4",
          "train.micro_batch=2", f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=3",
          "train.eval_batches=1", f"checkpoint.every={CHECKPOINT_STEP}", "checkpoint.keep_last=2",
          "schedule.warmup_steps=2", "device=cpu", "data.num_workers=1",
          "logger.progress_bar=false", "seed=0"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_dim=64"]


def cases() -> dict[str, tuple[str, str, str, int]]:
    """Every case by name: (model kind, scale, optimizer, ranks)."""
    return {f"{m}-{s}-{o}-{r}rank": (m, s, o, r)
            for m, s, o, r in itertools.product(MODELS, SCALES, OPTIMS, RANKS)}


def overrides(case: tuple[str, str, str, int], data_cache: Path, run_dir: Path,
              resume: str) -> list[str]:
    kind, scale, optim, _ = case
    return [f"model={MODELS[kind]}", *COMMON, *(MOE if kind == "moe" else []), f"scale={scale}",
            f"optim={optim}",
            f"data.cache_dir={data_cache}", f"run_dir={run_dir}", f"resume={resume}"]


def train(case: tuple[str, str, str, int], args: list[str], log: Path) -> None:
    ranks = case[3]
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"),
                                          os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as f:
        done = subprocess.run([*launcher, "-m", "scalevec_train.train", *args], cwd=ROOT, env=env,
                              stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"error: a run exited with {done.returncode}; its log: {log}")


def numbers(run_dir: Path, first_step: int = 1) -> dict[str, list]:
    """[step, value] of every loss, gradient norm and validation loss the run logged from first_step
    on."""
    rows = [r for r in read_records(run_dir / "metrics.jsonl") if r["step"] >= first_step]
    return {key: [[r["step"], r[key]] for r in rows if key in r]
            for key in ("loss", "grad_norm", "val_loss")}


def run_case(name: str, case, root: Path, data_cache: Path, checkpoint: Path | None) -> dict:
    """The case's full run and its run resumed from `checkpoint` (default: the full run's own step-6
    one)."""
    full, resumed = root / name / "full", root / name / "resumed"
    for d in (full, resumed):
        shutil.rmtree(d, ignore_errors=True)
    full.parent.mkdir(parents=True, exist_ok=True)
    train(case, overrides(case, data_cache, full, "none"), root / name / "full.log")
    source = checkpoint or full / "checkpoints" / f"step_{CHECKPOINT_STEP:06d}"
    shutil.copytree(source, resumed / "checkpoints" / source.name)
    train(case, overrides(case, data_cache, resumed, "auto"), root / name / "resumed.log")
    return {"full": numbers(full), "resumed": numbers(resumed, CHECKPOINT_STEP + 1)}


def continuation(numbers_of_full: dict) -> dict:
    return {k: [p for p in v if p[0] > CHECKPOINT_STEP] for k, v in numbers_of_full.items()}


def differences(name: str, want: dict, got: dict) -> list[str]:
    out = []
    for key in want:
        if len(want[key]) != len(got.get(key, [])):
            out.append(f"{name}: {len(got.get(key, []))} values of {key}, expected "
                       f"{len(want[key])}")
            continue
        out += [f"{name}: step {w[0]} {key} {g[1]!r}, expected {w[1]!r}"
                for w, g in zip(want[key], got[key], strict=True) if w != g]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("record", "check"))
    p.add_argument("dir", type=Path, help="where the recording is (check) or goes (record)")
    p.add_argument("--cases", default="*", help="shell pattern of the case names to run")
    args = p.parse_args()
    chosen = {n: c for n, c in cases().items() if fnmatch.fnmatch(n, args.cases)}
    if not chosen:
        sys.exit(f"error: no case matches {args.cases!r}. Fix: a pattern over "
                 f"{', '.join(cases())}.")
    args.dir.mkdir(parents=True, exist_ok=True)
    results_path = args.dir / "results.json"
    if args.mode == "check" and not results_path.is_file():
        sys.exit(f"error: {results_path} does not exist. Fix: record first (python "
                 f"dev/bit_matrix.py record {args.dir}) with the code to compare against.")
    recorded = json.loads(results_path.read_text()) if results_path.is_file() else {}
    work = args.dir if args.mode == "record" else args.dir / "check"
    data_cache = args.dir / "data_cache"
    problems = []
    for name, case in chosen.items():
        if args.mode == "record":
            got = run_case(name, case, work, data_cache, None)
            recorded[name] = got
            results_path.write_text(json.dumps(recorded, indent=1))
            found = differences(f"{name} (resumed against full)", continuation(got["full"]),
                                got["resumed"])
        else:
            if name not in recorded:
                sys.exit(f"error: {results_path} has no case {name}. Fix: record it.")
            old_checkpoint = (args.dir / name / "full" / "checkpoints"
                              / f"step_{CHECKPOINT_STEP:06d}")
            got = run_case(name, case, work, data_cache, old_checkpoint)
            found = (differences(f"{name} (full)", recorded[name]["full"], got["full"])
                     + differences(f"{name} (resumed from the recorded checkpoint)",
                                   continuation(recorded[name]["full"]), got["resumed"]))
        print(f"{name}: {'identical' if not found else f'{len(found)} difference(s)'}", flush=True)
        problems += found
    print("\n".join(problems) if problems else f"all {len(chosen)} case(s) identical")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""scalevec against torchtitan on one GPU: the same Llama-style shape, sequence, batch and
precision.

Runs torchtitan's own trainer (torchrun -m torchtitan.train: its Llama 3 model, per-block
torch.compile of the model and the loss, fused AdamW, bf16 autocast on one device), then scalevec's
scripts/bench_train.py, one right after the other, and prints each framework's tokens/s per device
with our ratio over theirs. torchtitan's train spec comes from scripts/torchtitan/scalevec_llama.py
(a scalevec dense preset's shape, random tokens); its tokens/s is the one torchtitan logs, over the
steps after the warm-up. Both untied, no activation checkpointing unless --ac full (whole blocks
recomputed in both). MFU is each framework's own count (torchtitan's leaves out the input embedding
and counts the whole attention square); the ratio of tokens/s is the comparison.

    python scripts/bench_torchtitan.py --preset dense-1b --seq-len 4096 --micro-batch 4

Needs torchtitan 0.2.2 (the last release before 0.3.0's rewrite, which asks for a PyTorch nightly;
the GPU host has torch 2.11) and the packages it imports; the GPU host installs their wheels from
.whl/ (dev/gpu_wheels.txt, as dev/gpu_session.sh says). Logs go to --out.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TITAN = ROOT / "scripts" / "torchtitan"
LOG_FREQ = 10
TITAN_LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)"
                        r".*?mfu:\s*([\d.]+)%")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="dense-1b", choices=["dense-0.12b", "dense-1b", "dense-2b"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4,
                   help="sequences per step (no accumulation)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (a multiple of 10)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (a multiple of 10)")
    p.add_argument("--ac", choices=["none", "full"], default="none",
                   help="activation checkpointing")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")),
                   help="folder for the logs")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    if args.warmup % LOG_FREQ or args.steps % LOG_FREQ or args.steps <= 0:
        p.error(f"--warmup and --steps must be multiples of {LOG_FREQ} (torchtitan logs tokens/s "
                f"every {LOG_FREQ} steps), --steps at least {LOG_FREQ}")
    return args


def run(name: str, cmd: list[str], log: Path, env: dict | None = None) -> str:
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    # the log's end here too: dev/gpu_session.sh copies back this output, not the log
    if proc.returncode:
        tail = "\n".join(text.splitlines()[-40:])
        sys.exit(f"{tail}\nerror: {name} exited with {proc.returncode}; its log: {log}")
    return text


def torchtitan_argv(args: argparse.Namespace, dump_folder: str) -> list[str]:
    """The arguments of `torchtitan.train` for this comparison."""
    return ["--experimental.custom_import", "scalevec_llama", "--model.name", "scalevec_llama",
            "--model.flavor", args.preset, "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.micro_batch),
            "--training.steps", str(args.warmup + args.steps), "--lr_scheduler.warmup_steps", "2",
            "--metrics.log_freq", str(LOG_FREQ), "--metrics.disable_color_printing",
            "--compile.enable", "--compile.components", "model,loss",
            "--activation_checkpoint.mode", args.ac, "--job.dump_folder", dump_folder]


def torchtitan_rate(log: str, warmup: int, steps: int) -> dict:
    """tokens/s, MFU and memory from torchtitan's log lines of the steps after the warm-up."""
    rows = [(float(mem), float(tps.replace(",", "")), float(mfu))
            for step, mem, tps, mfu in TITAN_LINE.findall(log) if int(step) > warmup]
    if len(rows) != steps // LOG_FREQ:
        raise ValueError(f"expected {steps // LOG_FREQ} torchtitan log lines after step {warmup}, "
                         f"found {len(rows)}")
    # every interval holds LOG_FREQ steps of the same tokens: the rate over all of them is the
    # harmonic mean
    return {"tokens/s/device": len(rows) / sum(1 / r[1] for r in rows),
            "MFU": f"{sum(r[2] for r in rows) / len(rows):.1f}%",
            "peak mem GiB": f"{max(r[0] for r in rows):.1f} (reserved)"}


def torchtitan(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    paths = [str(TITAN), str(ROOT), str(ROOT / "kernels")]
    if importlib.util.find_spec("datasets") is None:
        paths.append(str(TITAN / "placeholders"))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "torchtitan.train", *torchtitan_argv(args, tempfile.mkdtemp(prefix="torchtitan_"))]
    log = args.out / "torchtitan.log"
    try:
        rate = torchtitan_rate(run("torchtitan", cmd, log, env), args.warmup, args.steps)
    except ValueError as e:
        sys.exit(f"error: {e}; see {log}")
    return {"framework": f"torchtitan {version('torchtitan')}", **rate}


def split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def scalevec_argv(args: argparse.Namespace) -> list[str]:
    """The arguments of scripts/bench_train.py for the same shape, untied like Llama 3."""
    return ["--presets", args.preset, "--scales", "baseline", "--seq-len", str(args.seq_len),
            "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
            "--steps", str(args.steps),
            "--", "model.tie_embeddings=false", f"distributed.activation_checkpointing={args.ac}"]


def scalevec(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "scripts/bench_train.py", *scalevec_argv(args)]
    text = run("scalevec", cmd, args.out / "scalevec.log")
    header = next((line for line in text.splitlines() if line.startswith("| preset")), None)
    row = next((line for line in text.splitlines() if line.startswith(f"| {args.preset} ")), None)
    if header is None or row is None:
        sys.exit(f"error: no result table in {args.out / 'scalevec.log'}")
    cells = dict(zip(split_row(header), split_row(row)))
    if not cells.get("tokens/s/device", "-").replace(",", "").isdigit():
        sys.exit(f"error: scalevec did not finish its timed steps ({cells.get('step ms')}); "
                 f"see {args.out / 'scalevec.log'}")
    return {"framework": "scalevec",
            "tokens/s/device": float(cells["tokens/s/device"].replace(",", "")),
            "MFU": cells["MFU"], "peak mem GiB": f"{cells['peak mem GiB']} (allocated)"}


def main() -> None:
    args = parse_args()
    if importlib.util.find_spec("torchtitan") is None:
        sys.exit("error: torchtitan is not installed. Fix: pip install torchtitan==0.2.2 "
                 "(on the GPU host, the wheels of dev/gpu_wheels.txt in .whl/, as "
                 "dev/gpu_session.sh says).")
    args.out.mkdir(parents=True, exist_ok=True)
    theirs = torchtitan(args)
    ours = scalevec(args)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.preset} untied, "
          f"seq_len {args.seq_len}, micro-batch {args.micro_batch}, bf16, per-block compile, "
          f"activation checkpointing {args.ac}, {args.steps} steps timed after {args.warmup}")
    cols = ["framework", "tokens/s/device", "MFU", "peak mem GiB"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in (theirs, ours):
        print("| " + " | ".join(f"{r[c]:,.0f}" if c == "tokens/s/device" else str(r[c])
                                for c in cols) + " |")
    print("scalevec / torchtitan tokens/s: "
          f"{ours['tokens/s/device'] / theirs['tokens/s/device']:.3f}")


if __name__ == "__main__":
    main()

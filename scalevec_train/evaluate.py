"""`python -m scalevec_train.evaluate <run_dir or checkpoint>`: the validation loss of a checkpoint on its
run's validation set (the same batches as the trainer's val_loss, so the numbers compare), in one process.

For an averaged checkpoint (checkpoint/average.py; also a run's weight EMA written out with
`average ... ema=last`) it also writes metrics.jsonl into that folder, one
record {"step": the step it stands for, "tokens": trained by then, "val_loss": ...}: with the
config.yaml the folder already holds, scripts/compare_runs.py reads it as a run of its own
(scalevec_analysis marks it as averaged), beside the run and its WSD cooldown branches.
"""

import json
import sys
from pathlib import Path

from scalevec_train.build import autocast_for, resolve_device, validation_batches
from scalevec_train.checkpoint.files import AVERAGED, read_train_state
from scalevec_train.data import check_vocab, prepare_data
from scalevec_train.errors import ScalevecError
from scalevec_train.interop.api import load, read_config, resolve
from scalevec_train.training.callbacks.evaluation import counted_targets, validation_loss

USAGE = "usage: python -m scalevec_train.evaluate <run_dir or checkpoints/step_N or averaged folder>"
METRICS_FILE = "metrics.jsonl"


def evaluate(path: str | Path) -> tuple[float, Path | None]:
    """(val_loss of the checkpoint at `path`, the metrics.jsonl written for an averaged one or None)."""
    run_dir, checkpoint = resolve(Path(path))
    cfg = read_config(run_dir)
    device = resolve_device(cfg.device)
    data = prepare_data(cfg.data)
    check_vocab(data, cfg.model.vocab_size)
    model, _ = load(checkpoint, device=device)
    sets = validation_batches(cfg, data, 0, 1)
    sets = sets if isinstance(sets, dict) else {"": sets}
    losses = {name: validation_loss(model, batches, device, autocast_for(cfg.train.dtype, device),
                                    counted_targets(batches))[0].item() for name, batches in sets.items()}
    # a mixture's val_loss: its sources' weighted mean (as the trainer's Evaluator records it)
    weights = {m.name: m.weight for m in cfg.data.mixture} or {"": 1.0}
    loss = sum(weights[name] * value for name, value in losses.items()) / sum(weights.values())
    state = read_train_state(checkpoint)
    if AVERAGED not in state:
        return loss, None
    # tokens: compare_runs' x axis; every step of a run takes the same number of tokens
    record = {"step": state["step"], "tokens": state["step"] * cfg.train.global_batch * cfg.train.seq_len,
              "val_loss": loss, **{f"val_loss/{name}": value for name, value in losses.items() if name}}
    (checkpoint / METRICS_FILE).write_text(json.dumps(record) + "\n")
    return loss, checkpoint / METRICS_FILE


def main(argv: list[str]) -> int:
    if len(argv) != 1 or "=" in argv[0]:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        loss, written = evaluate(argv[0])
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"val_loss {loss:.6f}" + (f" (recorded in {written})" if written else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

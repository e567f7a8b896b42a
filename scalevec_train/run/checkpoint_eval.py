"""A checkpoint evaluated after training, in one process (the command:
`python -m scalevec_train.evaluate`): the validation loss and bits per byte on its run's validation
set (the same batches and computation as the trainer's val_loss and val_bpb, so the numbers compare)
and, when asked, downstream tasks: a preset of configs/tasks/ (`embedded`: the task the embedded
corpus brings; `standard`: the public task files under the run's tasks.dir) or `run` (the tasks the
run's config names), as the trainer's task/<name>/<metric>.

For an averaged checkpoint (checkpoint/averaging.py; also a run's weight EMA written out with
`average ... ema=last`) it also writes metrics.jsonl into that folder, one record {"step": the step
it stands for, "tokens": trained by then, "val_loss": ..., "val_bpb": ..., task metrics}: with the
config.yaml the folder already holds, scripts/compare_runs.py reads it as a run of its own
(scalevec_analysis marks it as averaged), beside the run and its WSD cooldown branches.
"""

import json
from pathlib import Path

from omegaconf import OmegaConf

from scalevec_train.checkpoint.files import AVERAGED, read_train_state
from scalevec_train.config import CONFIG_DIR, Config
from scalevec_train.data import check_vocab, prepare_data
from scalevec_train.data.sources import validation_batches
from scalevec_train.data.tokenizer import token_bytes
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.interop.api import load, read_config, resolve
from scalevec_train.run.build import autocast_for, resolve_device
from scalevec_train.tasks.config import TasksConfig
from scalevec_train.tasks.load import load_tasks
from scalevec_train.tasks.scoring import score
from scalevec_train.training.callbacks.evaluation import Validation

METRICS_FILE = "metrics.jsonl"
TASK_PRESETS = Path(CONFIG_DIR) / "tasks"


def evaluate(path: str | Path, tasks: str = "",
             verify: bool = True) -> tuple[dict[str, float], Path | None]:
    """({"val_loss": ..., "val_bpb": ... (a mixture's also per source, as the trainer records them),
    "task/<name>/<metric>": ... for the tasks of `tasks` (see the module docstring; empty: none)},
    the metrics.jsonl written for an averaged checkpoint or None). `verify`: as for load()."""
    run_dir, checkpoint = resolve(Path(path))
    cfg = read_config(run_dir)
    tasks_cfg = tasks_config(cfg, tasks) if tasks else None
    device = resolve_device(cfg.device)
    data = prepare_data(cfg.data)
    check_vocab(data, cfg.model.vocab_size)
    tok = data.load_tokenizer()
    encoded = load_tasks(tasks_cfg, cfg.data, tok, cfg.model.max_seq_len) if tasks_cfg else []
    model, _ = load(checkpoint, device=device, verify=verify)
    # the trainer's own validation on the same batches: the same val_loss, val_bpb and a mixture's
    # per source
    batches = validation_batches(data, cfg.train.seq_len, cfg.train.micro_batch,
                                 cfg.train.eval_batches * cfg.train.global_batch, 0, 1,
                                 cfg.model.attention_mask == "document")
    validation = Validation(batches, token_bytes(tok),
                            {m.name: m.weight for m in cfg.data.mixture} or None)
    autocast = autocast_for(cfg.train.dtype, device)
    metrics = {name: value.item()
               for name, value in validation.metrics(model, device, autocast).items()}
    for task in encoded:
        for name, value in score(model, task, device, autocast, tasks_cfg.batch_size).items():
            metrics[f"task/{task.name}/{name}"] = float(value)
    state = read_train_state(checkpoint)
    if AVERAGED not in state:
        return metrics, None
    # tokens: compare_runs' x axis; every step of a run takes the same number of tokens
    record = {"step": state["step"],
              "tokens": state["step"] * cfg.train.global_batch * cfg.train.seq_len, **metrics}
    (checkpoint / METRICS_FILE).write_text(json.dumps(record) + "\n")
    return metrics, checkpoint / METRICS_FILE


def tasks_config(cfg: Config, tasks: str) -> TasksConfig:
    """The run's own tasks (`run`), or a preset of configs/tasks/ with the run's tasks.dir and batch
    size."""
    if tasks == "run":
        chosen = cfg.tasks
    else:
        preset = TASK_PRESETS / f"{tasks}.yaml"
        if not preset.is_file():
            names = sorted(p.stem for p in TASK_PRESETS.glob("*.yaml"))
            raise ScalevecError("tasks", f"{tasks!r} is no preset of configs/tasks.",
                                "use tasks=run or one of: "
                                f"{', '.join(f'tasks={n}' for n in names)}.")
        base = OmegaConf.structured(TasksConfig(dir=cfg.tasks.dir, batch_size=cfg.tasks.batch_size))
        chosen = OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.load(preset)))
    chosen.validate()
    if not chosen.items:
        raise ScalevecError("tasks", f"{tasks} names no tasks.",
                            "use tasks=embedded, or a preset that lists some.")
    return chosen

"""EpochMonitor: the passes over the training split in every logged record, and the warning at the
start of a run that would make more than a few. Reference: the sequences a pass holds, from the
split's manifest ((tokens - 1) // seq_len), and the sequences each step draws
(train.global_batch)."""

import json
import shutil

from scalevec_train.data import prepare_data
from scalevec_train.train import run
from tests.support.helpers import make_config
from tests.support.presets import TINY_MODEL

TINY = [*TINY_MODEL, "model.vocab_size=512", "train.seq_len=64", "train.global_batch=32",
        "train.micro_batch=32", "train.eval_batches=1", "train.eval_every=0", "train.log_every=1",
        "schedule.warmup_steps=1", "device=cpu", "data.num_workers=1", "logger.progress_bar=false"]


def test_epochs_are_logged_and_many_are_warned_about(corpus_dir, tmp_path, capsys):
    # a small corpus, that a short run passes over many times
    for name in ("string.py", "textwrap.py"):
        (tmp_path / "texts").mkdir(exist_ok=True)
        shutil.copy(corpus_dir / name, tmp_path / "texts" / name)
    common = [*TINY, "data=text_dir", f"data.path={tmp_path / 'texts'}",
              f"data.cache_dir={tmp_path / 'cache'}"]
    windows = (prepare_data(make_config(*common).data).manifest["train"]["num_tokens"] - 1) // 64
    steps = 4 * windows // 32 + 2
    assert steps * 32 / windows > 4 > 32 / windows
    records = [json.loads(line) for line in
               (run(make_config(*common, f"train.steps={steps}", f"run_dir={tmp_path / 'long'}"))
                / "metrics.jsonl").read_text().splitlines()]
    assert [r["epochs"] for r in records if "loss" in r] == [step * 32 / windows
                                                             for step in range(1, steps + 1)]
    assert (f"take {steps * 32 / windows:.1f} passes over the training data"
            in capsys.readouterr().err)
    run(make_config(*common, "train.steps=1", f"run_dir={tmp_path / 'short'}"))
    assert "passes over the training data" not in capsys.readouterr().err

"""A training step that does not log reads nothing back from the device (issue 28): counted with a
TorchDispatchMode (tests/support/host_reads.py) over the steps between logs, for dense and MoE,
AdamW and Muon (and document masking with the z-loss, and the weight EMA), on 1 process and on 2
gloo ranks. Reads of the optimizer's host-side step counters (torch's for-loop AdamW on CPU) are
counted apart and not held against the framework; Muon keeps its counters on the device and makes
none. A deliberate item() or tolist() in every forward is counted, read for read: a read the
framework made would not go unseen."""

import json
from pathlib import Path

import pytest
import torch

from scalevec_train.data import prepare_data
from scalevec_train.model import Transformer
from tests.support.helpers import make_config
from tests.support.host_reads import ReadCounter, count_reads
from tests.support.launch import assert_identical, gloo_group, spawn, trained_state
from tests.support.presets import SMALL_MODEL

SHAPE = [*SMALL_MODEL, "model.ffn_dim=64",
         "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.eval_batches=1",
         "train.eval_every=0", "train.steps=6", "train.log_every=3", "schedule.warmup_steps=2"]
MODELS = {"dense": ["model=dense-tiny"], "moe": ["model=moe-tiny", "model.moe.expert_dim=32"],
          # counts of counted targets normalize the loss, and the z-loss is recorded on log steps
          "document": ["model=dense-tiny", "model.attention_mask=document", "model.rope_reset=true",
                       "train.z_loss=1e-4"],
          # the weight EMA updates on the device after every step (a skipped one selects no move)
          "ema": ["model=moe-tiny", "model.moe.expert_dim=32", "train.ema.half_life_tokens=256"]}
CASES = ([(model, optim) for model in ("dense", "moe") for optim in ("adamw", "muon")]
         + [("document", "adamw"), ("ema", "muon")])


def overrides(data_overrides, model: str, optim: str, run_dir) -> list[str]:
    return [*data_overrides, *MODELS[model], *SHAPE, f"optim={optim}", "scale=unified",
            f"run_dir={run_dir}"]


def test_the_counter_sees_item_and_bool():
    counter = ReadCounter(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    counter.start()
    try:
        torch.ones(()).item()
        bool(torch.ones(()) > 0)
    finally:
        counter.stop()
    assert counter.reads == 2


@pytest.mark.parametrize("read", ["item", "tolist"])
def test_a_read_between_logs_is_counted(data_overrides, tmp_path, monkeypatch, read):
    """What the no-reads tests would see of a read the framework made: a deliberate `read` of one
    logit in every forward is 2 reads a step (2 micro-batches), 8 over the 4 steps that do not log.
    item() reaches the counter as an aten call; tolist() on the CPU reads without one (count_reads'
    own patch counts it), and counted once."""
    forward = Transformer.forward

    def reading(self, *args, **kwargs):
        logits = forward(self, *args, **kwargs)
        getattr(logits[0, 0, 0].detach(), read)()
        return logits

    monkeypatch.setattr(Transformer, "forward", reading)
    out = tmp_path / "reads.json"
    count_reads(overrides(data_overrides, "dense", "adamw", tmp_path / "run"), out)
    counts = json.loads(out.read_text())
    assert counts["steps"] == 4 and counts["reads"] == 4 * 2, counts


@pytest.mark.parametrize("model,optim", CASES)
def test_no_reads_between_logs_on_one_process(data_overrides, tmp_path, model, optim):
    out = tmp_path / "reads.json"
    count_reads(overrides(data_overrides, model, optim, tmp_path / "run"), out)
    counts = json.loads(out.read_text())
    assert counts["steps"] == 4 and counts["reads"] == 0, counts
    # copy-restore only for for-loop AdamW
    assert (counts["copies"] == 0) == (optim == "muon"), counts
    if optim == "muon":
        assert counts["step_counter_reads"] == 0, counts


def test_no_reads_between_logs_with_a_data_mixture(corpus_dir, tmp_path):
    """A mixture's loader, per-source evaluation and epochs/<name> read nothing between logs
    either."""
    out = tmp_path / "reads.json"
    mixture = (f"data.mixture=[{{name:a,source:text_dir,path:'{corpus_dir}',"
               f"patterns:['[a-j]*.py']}},"
               f"{{name:b,source:text_dir,path:'{corpus_dir}',patterns:['[k-z]*.py'],weight:0.5}}]")
    count_reads([mixture, f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=512",
                 "logger.progress_bar=false", *MODELS["dense"], *SHAPE, "optim=adamw",
                 "scale=unified", f"run_dir={tmp_path / 'run'}"], out)
    counts = json.loads(out.read_text())
    assert counts["steps"] == 4 and counts["reads"] == 0, counts
    assert {"val_loss/a", "val_loss/b", "epochs/a"} <= json.loads(
        (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1]).keys()


def _count_reads(rank: int, world: int, store: str, spec: list) -> None:
    """What `torchrun tests/support/host_reads.py` does on each rank, in a process spawn()
    forked."""
    with gloo_group(store, rank, world):
        for out, run_overrides in spec:
            count_reads(run_overrides, Path(out))


def test_no_reads_between_logs_on_two_ranks(data_overrides, tmp_path):
    """On 2 gloo ranks (FSDP2) every case reads nothing between logs, and under Muon neither a step
    counter nor a copy; one group of 2 ranks trains every case (tests/support/host_reads.py, one run
    after the other)."""
    prepare_data(make_config(*data_overrides).data)  # once, not by 2 ranks at a time
    outs = {case: tmp_path / "{}-{}-{{rank}}.json".format(*case) for case in CASES}
    spec = [[str(outs[model, optim]),
             overrides(data_overrides, model, optim, tmp_path / f"{model}-{optim}")]
            for model, optim in CASES]
    spawn(_count_reads, (2, str(tmp_path / "store"), spec))
    for (model, optim), out in outs.items():
        for rank in (0, 1):
            counts = json.loads(Path(str(out).format(rank=rank)).read_text())
            assert counts["steps"] == 4 and counts["reads"] == 0, (model, optim, rank, counts)
            if optim == "muon":
                assert counts["step_counter_reads"] == counts["copies"] == 0, (model, optim, rank,
                                                                               counts)


def test_a_skipped_step_between_logs_is_judged_and_logged_at_the_next_read_back(
        data_overrides, tmp_path, monkeypatch):
    """A NaN loss at step 5 with logs every 4 steps and an evaluation at step 6: the step is skipped
    on the device, and at step 6 (an evaluation reads back) the guard reads steps 5-6, writes step
    5's record and counts it; records stay in step order. Against a run that reads back every step
    (log_every=1): the same record for step 5, the same losses and parameters."""
    from scalevec_train.checkpoint import files as checkpoint_files
    from scalevec_train.train import run
    from tests.support.launch import records

    monkeypatch.setenv("SCALEVEC_FAULT_AT", "step.loss:5=nan")
    common = [*data_overrides, *MODELS["moe"], *SHAPE, "train.steps=8", "train.eval_every=6",
              "optim=adamw"]
    lazy = run(make_config(*common, "train.log_every=4", f"run_dir={tmp_path / 'lazy'}"))
    eager = run(make_config(*common, "train.log_every=1", f"run_dir={tmp_path / 'eager'}"))
    assert [r["step"] for r in records(lazy)] == [0, 4, 5, 6, 8]
    by_step = {r["step"]: r for r in records(lazy)}
    assert by_step[5] == {"step": 5, "tokens": 5 * 128, "lr": by_step[5]["lr"], "skipped_steps": 1,
                          "bad_step": True, "bad_loss": "nan", "bad_grad_norm": "nan"}
    assert by_step[4]["skipped_steps"] == 0 and by_step[8]["skipped_steps"] == 1
    expected = {r["step"]: r for r in records(eager)}
    assert expected[5]["bad_step"] is True and expected[5]["lr"] == by_step[5]["lr"]
    for step in (4, 8):
        assert by_step[step]["loss"] == expected[step]["loss"]
    assert by_step[6]["val_loss"] == expected[6]["val_loss"]
    assert_identical(trained_state(checkpoint_files.step_dir(lazy, 8), tmp_path),
                     trained_state(checkpoint_files.step_dir(eager, 8), tmp_path))


def test_divergence_between_logs_stops_at_the_next_log_with_the_guard_error(
        data_overrides, tmp_path, monkeypatch):
    from scalevec_train.infra.errors import DivergedError
    from scalevec_train.train import run
    from tests.support.launch import records

    monkeypatch.setenv("SCALEVEC_FAULT_AT", "step.loss:2=nan,step.loss:3=nan")
    with pytest.raises(DivergedError) as caught:
        run(make_config(*data_overrides, *MODELS["dense"], *SHAPE, "train.steps=8",
                        "train.log_every=4", "train.max_bad_steps=2", f"run_dir={tmp_path / 'r'}"))
    assert str(caught.value).startswith("training (steps 2-3): 2 steps in a row had a "
                                        "non-finite loss")
    assert ("The checkpoint of step 4 holds the parameters and optimizer state of step 4"
            in str(caught.value))
    assert (records(tmp_path / "r")[-1]["stopped"] == "diverged"
            and records(tmp_path / "r")[-1]["step"] == 4)

"""The weight EMA (train.ema.half_life_tokens, training/callbacks/ema.py) on one process: against
the debiased EMA computed here in fp64 from the run's weights after every step (each step's
checkpoint, read by DCP's own dcp_to_torch_save); a skipped step leaves it as it was; off, or on,
the run's own numbers are the same bit for bit; a resume continues it bit for bit; val_loss_ema is
the val_loss of the EMA weights loaded as a model; the EMA written out as a folder loads, exports,
evaluates and shows in compare_runs. tests/parallel/test_ema_ranks.py has 2 ranks and resumes across
world sizes."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from scalevec_analysis.grouping import group_runs
from scalevec_analysis.runs import ema_run, load_run_dir
from scalevec_train import average as average_cli
from scalevec_train.checkpoint.averaging import ema_model
from scalevec_train.checkpoint.files import COMPLETE, step_dir
from scalevec_train.costs.memory import estimate
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import FAULT_AT_ENV
from scalevec_train.interop.api import load
from scalevec_train.interop.hf_export import export
from scalevec_train.model import Transformer
from scalevec_train.run.checkpoint_eval import evaluate
from scalevec_train.train import run
from scalevec_train.training.callbacks import WeightEMA
from tests.support.helpers import REPO, SHORT_RUN, load_script, make_config
from tests.support.launch import checkpoint_state, curve, records
from tests.support.presets import TINY_MODEL

STEPS, HALF_LIFE = 12, 256
TOKENS_PER_STEP = 4 * 32  # SHORT_RUN: 4 sequences of 32 tokens
DECAY = 0.5 ** (TOKENS_PER_STEP / HALF_LIFE)
# a checkpoint after every step: the weights the reference averages
RUN = [*TINY_MODEL, *SHORT_RUN, f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=4",
       "optim.lr=1e-2", "schedule=constant", "checkpoint.every=1", f"checkpoint.keep_last={STEPS}"]
EMA = [f"train.ema.half_life_tokens={HALF_LIFE}"]


@pytest.fixture(scope="module")
def runs(data_overrides, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ema_runs")
    return {name: run(make_config(*data_overrides, *RUN, *extra, f"run_dir={root / name}"))
            for name, extra in (("on", EMA), ("off", []))}


def saved(run_dir: Path, step: int, scratch: Path) -> dict:
    return checkpoint_state(step_dir(run_dir, step), scratch)


def reference_ema(weights: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """sum_i (1 - d) d^(n-i) w_i / (1 - d^n) over the weights after the n steps taken, in fp64."""
    n = len(weights)
    return {name: sum((1 - DECAY) * DECAY ** (n - i) * w[name].double()
                      for i, w in enumerate(weights, 1))
            / (1 - DECAY ** n) for name in weights[-1]}


def assert_ema(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """fp32 updates against fp64 sums: about 1e-7 relative per step; a step more or less, or the
    initial weights kept in, is off by about lr = 1e-2."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name].double(), value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_the_ema_is_the_debiased_mean_of_the_weights_after_each_step(runs, tmp_path):
    states = [saved(runs["on"], s, tmp_path) for s in range(1, STEPS + 1)]
    for k in (1, 2, 5, STEPS):
        ema = states[k - 1]["ema"]
        assert ema["count"].item() == k
        assert_ema(ema["weights"], reference_ema([s["model"] for s in states[:k]]))
    last = states[-1]  # neither the last weights nor the first
    for other in (states[0], last):
        assert any(not torch.equal(last["ema"]["weights"][n], w) for n, w in other["model"].items())


def test_off_and_on_train_the_same_run_bit_for_bit(runs, tmp_path):
    """The EMA changes nothing of the run (its evaluations swap the weights back exactly), and off
    it leaves no trace: no EMA tensors, no EMA metrics."""
    for key in ("loss", "grad_norm", "val_loss", "val_bpb"):
        assert curve(runs["on"], key) == curve(runs["off"], key), key
    on, off = saved(runs["on"], STEPS, tmp_path), saved(runs["off"], STEPS, tmp_path)
    assert "ema" not in off and off.keys() | {"ema"} == on.keys()
    assert all(torch.equal(on["model"][n], w) for n, w in off["model"].items())
    assert not any("ema" in key for r in records(runs["off"]) for key in r)
    assert sorted(curve(runs["on"], "val_loss_ema")) == [0, 4, 8, 12]
    # the EMA starts at the weights
    assert curve(runs["on"], "val_loss_ema")[0] == curve(runs["on"], "val_loss")[0]


def test_val_loss_ema_is_the_val_loss_of_the_ema_weights(runs, tmp_path):
    """The EMA folder of step 12 loaded as a model and evaluated on its own (evaluate.py): the
    loop's val_loss_ema and val_bpb_ema of that step; it loads and exports like an average."""
    out = ema_model(runs["on"], tmp_path / "ema")
    ema = saved(runs["on"], STEPS, tmp_path)["ema"]["weights"]
    model, _ = load(out)
    assert all(torch.equal(model.state_dict()[n], w) for n, w in ema.items())
    metrics, written = evaluate(out)
    loss = metrics["val_loss"]
    assert written == out / "metrics.jsonl"
    assert loss == pytest.approx(curve(runs["on"], "val_loss_ema")[STEPS], rel=1e-6)
    assert loss != pytest.approx(curve(runs["on"], "val_loss")[STEPS], rel=1e-4)
    assert json.loads(written.read_text())["val_bpb"] == pytest.approx(
        curve(runs["on"], "val_bpb_ema")[STEPS], rel=1e-6)
    assert (export(out, tmp_path / "hf") / "model.safetensors").is_file()


def test_a_skipped_step_leaves_the_ema_as_it_was(data_overrides, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_AT_ENV, "step.loss:3=nan")
    run_dir = run(make_config(*data_overrides, *RUN, *EMA, "train.steps=5",
                              f"run_dir={tmp_path / 'run'}"))
    states = [saved(run_dir, s, tmp_path) for s in range(1, 6)]
    assert curve(run_dir, "skipped_steps")[5] == 1
    assert states[2]["ema"]["count"].item() == 2
    for name, value in states[1]["ema"]["weights"].items():
        assert torch.equal(states[2]["ema"]["weights"][name], value), name
    taken = [states[i]["model"] for i in (0, 1, 3, 4)]
    assert_ema(states[4]["ema"]["weights"], reference_ema(taken))


def resumable_copy(run_dir: Path, dst: Path, keep_step: int) -> Path:
    """A copy of `run_dir` whose checkpoints after `keep_step` are incomplete (resume=auto passes
    them)."""
    shutil.copytree(run_dir, dst)
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > keep_step:
            (ckpt / COMPLETE).unlink()
    return dst


def test_a_resume_continues_the_ema_bit_for_bit(runs, data_overrides, tmp_path):
    resumed = resumable_copy(runs["on"], tmp_path / "resumed", keep_step=6)
    run(make_config(*data_overrides, *RUN, *EMA, f"run_dir={resumed}", "resume=auto"))
    got, want = saved(resumed, STEPS, tmp_path)["ema"], saved(runs["on"], STEPS, tmp_path)["ema"]
    assert torch.equal(got["count"], want["count"])
    assert all(torch.equal(got["weights"][n], w) for n, w in want["weights"].items())
    assert curve(resumed, "val_loss_ema") == curve(runs["on"], "val_loss_ema")


def test_turned_on_at_a_resume_the_ema_starts_from_the_resumed_weights(
        runs, data_overrides, tmp_path, capsys):
    resumed = resumable_copy(runs["off"], tmp_path / "late", keep_step=6)
    run(make_config(*data_overrides, *RUN, *EMA, f"run_dir={resumed}", "resume=auto"))
    assert "holds no EMA of the weights; it starts here" in capsys.readouterr().err
    weights = [saved(runs["off"], s, tmp_path)["model"] for s in range(7, STEPS + 1)]
    assert_ema(saved(resumed, STEPS, tmp_path)["ema"]["weights"], reference_ema(weights))
    assert curve(resumed, "loss") == curve(runs["off"], "loss")


def test_compare_runs_shows_the_ema_beside_the_run(runs, tmp_path, capsys):
    out = tmp_path / "ema-cli"
    assert average_cli.main([str(runs["on"]), "ema=8", f"out={out}"]) == 0
    evaluate(out)
    source, folder = load_run_dir(runs["on"]), load_run_dir(out)
    curve_run = ema_run(source)
    assert ema_run(load_run_dir(runs["off"])) is None
    assert ([(r["step"], r["val_loss"]) for r in curve_run.records]
            == sorted(curve(runs["on"], "val_loss_ema").items()))
    assert folder.records[0]["step"] == 8
    assert folder.records[0]["val_loss"] == pytest.approx(curve(runs["on"], "val_loss_ema")[8],
                                                          rel=1e-6)
    # the EMA's train.ema keys do not split runs: a run without it groups with one that has it
    groups = group_runs([source, load_run_dir(runs["off"]), curve_run, folder])
    assert [(g.label, len(g.runs)) for g in groups] == [
        ("averaged=(unset) ema=(unset)", 2), ("averaged=(unset) ema=half-life 256 tokens", 1),
        ("averaged=ema@8 ema=(unset)", 1)]
    pytest.importorskip("matplotlib")
    compare = load_script(REPO / "scripts" / "compare_runs.py")
    assert compare.main([str(runs["on"]), str(out), "--weight-ema", "--reference",
                         "averaged=(unset) ema=(unset)", "--out", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert "ema=half-life 256 tokens" in table and "averaged=ema@8" in table


def test_bad_inputs(runs, tmp_path):
    with pytest.raises(ScalevecError,
                       match="holds no EMA of the weights: the run was trained without one"):
        ema_model(runs["off"], tmp_path / "a")
    with pytest.raises(ScalevecError, match="step_000013: is not a complete checkpoint"):
        ema_model(runs["on"], tmp_path / "a", step=13)
    with pytest.raises(ScalevecError, match="train.ema.half_life_tokens"):
        make_config(*EMA[:0], "train.ema.half_life_tokens=-1")
    assert not (tmp_path / "a").exists()


def test_the_memory_estimate_counts_the_ema():
    """describe's memory per rank: the EMA's bytes, those of the callback's tensors on a real
    model."""
    cfg = make_config("model=moe-tiny", "scale=unified", *EMA)
    model = Transformer(cfg.model, cfg.scale)
    held = WeightEMA(model, decay=DECAY, validation=None, every=0).weights.values()
    assert estimate(cfg, world=1, device="cpu").ema == sum(t.numel() * t.element_size()
                                                           for t in held)
    assert estimate(make_config("model=moe-tiny"), world=1, device="cpu").ema == 0


def test_a_mixture_records_each_sources_ema_loss(corpus_dir, tmp_path):
    """val_loss_ema/<source> beside val_loss/<source>; val_loss_ema their weighted mean (weights 1
    and 0.5); compare_runs' EMA run reads them under the run's own names."""
    mixture = (f"data.mixture=[{{name:a,source:text_dir,path:'{corpus_dir}',"
               f"patterns:['[a-j]*.py']}},"
               f"{{name:b,source:text_dir,path:'{corpus_dir}',patterns:['[k-z]*.py'],weight:0.5}}]")
    run_dir = run(make_config(mixture, f"data.cache_dir={tmp_path / 'cache'}",
                              "model.vocab_size=512", "logger.progress_bar=false", *RUN, *EMA,
                              "train.steps=4", "checkpoint.every=0", f"run_dir={tmp_path / 'run'}"))
    last = {k: v for r in records(run_dir) if r["step"] == 4 for k, v in r.items()}
    assert last["val_loss_ema"] == pytest.approx((2 * last["val_loss_ema/a"]
                                                  + last["val_loss_ema/b"]) / 3, rel=1e-6)
    assert last["val_loss_ema/a"] != pytest.approx(last["val_loss/a"], rel=1e-4)
    first = {k: v for r in records(run_dir) if r["step"] == 0 for k, v in r.items()}
    assert first["val_loss_ema/b"] == first["val_loss/b"]
    ema_records = ema_run(load_run_dir(run_dir)).records
    assert ema_records[-1]["val_loss/a"] == last["val_loss_ema/a"]
    assert ema_records[-1]["val_bpb/b"] == last["val_bpb_ema/b"]

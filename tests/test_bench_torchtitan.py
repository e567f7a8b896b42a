"""scripts/bench_torchtitan.py short of its GPU run (torchtitan's trainer runs on CUDA only): the
train spec it registers builds torchtitan's Llama 3 in the shape of scalevec's dense presets, the
arguments it passes parse as torchtitan's, its data are next-token pairs, torchtitan's log lines
give the rate it reports, and torchtitan imports with the stand-in for a missing Hugging Face
datasets. torchtitan 0.2.2 and datasets are dev dependencies, so CI runs every test; where
torchtitan is missing they skip, and where datasets is (the GPU host) the tests of torchtitan's own
modules skip, which import it, and the stand-in's runs."""

import os
import subprocess
import sys

import pytest
import torch

from scalevec_train.config import compose_config
from scalevec_train.costs.tables import build_meta
from tests.support.helpers import REPO, load_script

TITAN = REPO / "scripts" / "torchtitan"
NEEDS = ("needs torchtitan 0.2.2 and Hugging Face datasets, which its train spec and config import "
         "(the dev extra)")


@pytest.fixture(scope="module")
def bench():
    return load_script(REPO / "scripts" / "bench_torchtitan.py")


@pytest.fixture(scope="module")
def spec():
    train_spec = pytest.importorskip("torchtitan.protocols.train_spec", reason=NEEDS)
    load_script(TITAN / "scalevec_llama.py")
    return train_spec.get_train_spec("scalevec_llama")


@pytest.mark.parametrize("preset", ["dense-0.12b", "dense-1b", "dense-2b"])
def test_flavor_has_the_presets_shape(spec, preset):
    with torch.device("meta"):
        theirs = spec.model_cls(spec.model_args[preset])
    cfg = compose_config([f"model={preset}", "model.tie_embeddings=false", "scale=baseline"])
    ours = build_meta(cfg.model, cfg.scale)
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters())
    assert len(theirs.layers) == cfg.model.n_layers
    ffn = theirs.layers["0"].feed_forward
    assert (ffn.w1.in_features, ffn.w1.out_features) == (cfg.model.dim, cfg.model.ffn_dim)
    assert theirs.tok_embeddings.weight.shape == (cfg.model.vocab_size, cfg.model.dim)


def test_arguments_are_torchtitans(bench, spec, tmp_path):
    args = bench.parse_args(["--preset", "dense-1b", "--seq-len", "256", "--micro-batch", "3",
                             "--ac", "full",
                             "--warmup", "10", "--steps", "20", "--out", str(tmp_path)])
    config = pytest.importorskip("torchtitan.config", reason=NEEDS)
    cfg = config.ConfigManager().parse_args(bench.torchtitan_argv(args, str(tmp_path / "dump")))
    assert (cfg.model.name, cfg.model.flavor) == ("scalevec_llama", "dense-1b")
    assert (cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps) == (256, 3, 30)
    assert cfg.compile.enable and cfg.compile.components == ["model", "loss"]
    assert cfg.activation_checkpoint.mode == "full"
    assert (cfg.metrics.log_freq, cfg.metrics.disable_color_printing) == (10, True)

    loader = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None, job_config=cfg)
    batches = [b for _, b in zip(range(9), loader)]
    for inputs, labels in ((b[0]["input"], b[1]) for b in batches):
        assert inputs.shape == labels.shape == (3, 256)
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        assert 0 <= int(inputs.min()) and int(inputs.max()) < 32000
    assert not torch.equal(batches[0][0]["input"], batches[1][0]["input"])
    # eight distinct batches, cycled
    assert torch.equal(batches[8][0]["input"], batches[0][0]["input"])


def test_rate_from_torchtitans_log_lines(bench):
    # torchtitan 0.2.2's line (components/metrics.py), colours off; steps 1 and 10 are the warm-up
    line = ("[rank0]:[titan] 2026-11-23 12:00:00,000 - root - INFO - step: {step:2}  loss:  "
            "7.12345  grad_norm:  1.2345  memory: {mem:5.2f}GiB(40.00%)  tps: {tps:,}  "
            "tflops: 123.45  mfu: {mfu:.2f}%")
    log = "\n".join(line.format(step=s, mem=m, tps=t, mfu=u)
                    for s, m, t, u in [(1, 9.0, 5, 0.1), (10, 30.0, 1_000, 1.0),
                                       (20, 31.5, 10_000, 40.0), (30, 31.0, 30_000, 50.0)])
    rate = bench.torchtitan_rate(log, warmup=10, steps=20)
    # equal tokens at 10,000 and 30,000 per second
    assert rate["tokens/s/device"] == pytest.approx(15_000)
    assert rate["MFU"] == "45.0%" and rate["peak mem GiB"] == "31.5 (reserved)"
    with pytest.raises(ValueError, match="expected 3 torchtitan log lines"):
        bench.torchtitan_rate(log, warmup=0, steps=30)


def test_torchtitan_imports_with_the_datasets_stand_in():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (the dev extra)")
    code = ("import datasets, torchtitan.models.llama3\n"
            f"assert datasets.__file__.startswith({str(TITAN / 'placeholders')!r}), "
            "datasets.__file__\n"
            "try:\n    datasets.load_dataset('c4')\nexcept RuntimeError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": str(TITAN / "placeholders")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "must not reach a torchtitan text loader" in out.stdout


def test_a_failed_run_prints_the_end_of_its_log(bench, tmp_path):
    """A GPU session brings back the benchmark's output, not the logs it writes: a failure's cause
    is in it."""
    script = "for i in range(100):\n    print('line', i)\nraise SystemExit(3)"
    with pytest.raises(SystemExit) as stopped:
        bench.run("demo", [sys.executable, "-c", script], tmp_path / "demo.log")
    message = str(stopped.value)
    assert "line 99" in message and "line 60" in message and "line 59\n" not in message
    assert message.endswith(f"error: demo exited with 3; its log: {tmp_path / 'demo.log'}")

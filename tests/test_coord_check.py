"""The coordinate check (python -m scalevec_train.coord_check, docs/concepts/parameterization.md): mup passes it on
dense and MoE models under baseline and unified with AdamW and Muon; sp fails it, and so does mup with its
readout multiplier taken out. The models are tiny (width 16 to 16 x 16, depth 1 to 8) and train 3 steps."""

import pytest

from scalevec_train import coord_check
from scalevec_train.model.parameterization import Parameterization
from scalevec_train.run import cli
from tests.support.helpers import make_config_shared

DENSE = ["model=dense-l1", "model.dim=16", "model.ffn_dim=48", "model.vocab_size=128"]
MOE = ["model=moe-tiny", "model.dim=16", "model.n_heads=1", "model.n_kv_heads=1", "model.ffn_dim=16",
       "model.n_layers=1", "model.moe.num_experts=4", "model.moe.expert_dim=16", "model.vocab_size=128"]
MODELS = {"dense": DENSE, "moe": MOE}
OPTIONS = ["widths=1,2,4,16", "depths=1,2,4,8", "steps=3", "batch=2", "seq=16"]


def check(model: str, scale: str, optim: str, parameterization: str) -> list[str]:
    """The quantities whose slope fails the check (empty: it passes)."""
    options, _ = cli.parse(OPTIONS, coord_check.Options)
    # one Hydra compose per model, strategy and optimizer: the mup and sp checks of one share it
    cfg = make_config_shared(*MODELS[model], f"scale={scale}", f"optim={optim}", "optim.lr=0.01",
                             f"model.parameterization={parameterization}")
    return coord_check.table(coord_check.run(cfg, options), options.bound, "")[1]


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("scale", ["baseline", "unified"])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_mup_passes(model, scale, optim):
    assert check(model, scale, optim, "mup") == []


@pytest.mark.parametrize("model,scale,optim", [("dense", "baseline", "adamw"), ("dense", "unified", "muon"),
                                               ("moe", "unified", "adamw"), ("moe", "baseline", "muon")])
def test_sp_fails(model, scale, optim):
    failed = check(model, scale, optim, "sp")
    # the logits grow with the width under any optimizer (the head learns at one LR for every width)
    assert "width: logits" in " ".join(failed)


@pytest.mark.parametrize("model,scale,optim", [("dense", "unified", "adamw"), ("moe", "baseline", "muon")])
def test_mup_without_its_readout_multiplier_fails(model, scale, optim, monkeypatch):
    monkeypatch.setattr(Parameterization, "readout", property(lambda self: 1.0))
    failed = " ".join(check(model, scale, optim, "mup"))
    assert "width: logits" in failed and "width: update:readout (tied)" in failed


def test_the_command_writes_its_table_and_exits_by_the_check(tmp_path, capsys):
    argv = [*DENSE, *OPTIONS, "optim.lr=0.01"]
    assert coord_check.main([*argv, "model.parameterization=mup", f"out={tmp_path / 'mup'}"]) == 0
    table = (tmp_path / "mup" / "table.md").read_text()
    assert "## Against width" in table and "## Against depth" in table and "FAIL" not in table
    assert coord_check.main([*argv, "model.parameterization=sp", f"out={tmp_path / 'sp'}"]) == 1
    assert "FAIL" in (tmp_path / "sp" / "table.md").read_text()
    assert "coordinate check FAILED" in capsys.readouterr().err
    assert coord_check.main([*argv, "widths=1"]) == 2  # one width gives no slope

"""The coordinate check (python -m scalevec_train.coord_check, docs/concepts/parameterization.md):
mup passes it on dense and MoE models under baseline and unified with AdamW and Muon, at the
ladder's shape (one block) and at the tiny presets' (four); sp fails it, and so does mup with its
readout multiplier or its residual branches' depth multiplier taken out. The models are tiny (width
16 to 16 x 16, depth 1 to 8) and train 3 steps."""

import pytest

from scalevec_train import coord_check
from scalevec_train.model.parameterization import Parameterization
from scalevec_train.run import cli
from tests.support.helpers import make_config_shared

DENSE = ["model=dense-l1", "model.dim=16", "model.ffn_dim=48", "model.vocab_size=128",
         "optim.lr=0.01"]
MOE = ["model=moe-tiny", "model.dim=16", "model.n_heads=1", "model.n_kv_heads=1",
       "model.ffn_dim=16", "model.n_layers=1", "model.moe.num_experts=4", "model.moe.expert_dim=16",
       "model.vocab_size=128", "optim.lr=0.01"]
OPTIONS = ["widths=1,2,4,16", "depths=1,2,4,8", "steps=3", "batch=2", "seq=16"]
# dense-tiny and moe-tiny at 1/16 of their widths (4 blocks, 2 query heads a KV head; 4 experts of
# its 8) at their own LR, as the command runs them (issue 62: at depth 1 the last block is the
# first, fed by the embedding). The command's batch and sequence: at 2 x 16 the logits' width slope
# falls below -0.5 there
DENSE_TINY = ["model=dense-tiny", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1",
              "model.ffn_dim=43", "model.vocab_size=128"]
MOE_TINY = ["model=moe-tiny", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1",
            "model.ffn_dim=8", "model.moe.num_experts=4", "model.moe.expert_dim=8",
            "model.vocab_size=128"]
TINY_OPTIONS = ["widths=1,2,4,16", "depths=1,2,4,8", "steps=3"]
MODELS = {"dense": (DENSE, OPTIONS), "moe": (MOE, OPTIONS),
          "dense-tiny": (DENSE_TINY, TINY_OPTIONS), "moe-tiny": (MOE_TINY, TINY_OPTIONS)}


def check(model: str, scale: str, optim: str, parameterization: str) -> list[str]:
    """The quantities whose slope fails the check (empty: it passes)."""
    overrides, given = MODELS[model]
    options, _ = cli.parse(given, coord_check.Options)
    # one Hydra compose per model, strategy and optimizer: the mup and sp checks of one share it
    cfg = make_config_shared(*overrides, f"scale={scale}", f"optim={optim}",
                             f"model.parameterization={parameterization}")
    return coord_check.table(coord_check.run(cfg, options), options.bound, "")[1]


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("scale", ["baseline", "unified"])
@pytest.mark.parametrize("model", ["dense", "moe", "dense-tiny", "moe-tiny"])
def test_mup_passes(model, scale, optim):
    assert check(model, scale, optim, "mup") == []


@pytest.mark.parametrize("model,scale,optim",
                         [("dense", "baseline", "adamw"), ("dense", "unified", "muon"),
                          ("moe", "unified", "adamw"), ("moe", "baseline", "muon"),
                          ("dense-tiny", "unified", "adamw"), ("moe-tiny", "baseline", "muon")])
def test_sp_fails(model, scale, optim):
    failed = check(model, scale, optim, "sp")
    # the logits grow with the width under any optimizer (the head learns at one LR for every width)
    assert "width: logits" in " ".join(failed)


@pytest.mark.parametrize("model,scale,optim",
                         [("dense", "unified", "adamw"), ("moe", "baseline", "muon")])
def test_mup_without_its_readout_multiplier_fails(model, scale, optim, monkeypatch):
    monkeypatch.setattr(Parameterization, "readout", property(lambda self: 1.0))
    failed = " ".join(check(model, scale, optim, "mup"))
    assert "width: logits" in failed and "width: update:readout (tied)" in failed


@pytest.mark.parametrize("model,scale,optim",
                         [("dense", "baseline", "adamw"), ("dense-tiny", "unified", "adamw"),
                          ("moe-tiny", "unified", "muon")])
def test_mup_without_its_depth_multiplier_fails(model, scale, optim, monkeypatch):
    monkeypatch.setattr(Parameterization, "residual", property(lambda self: 1.0))
    failed = check(model, scale, optim, "mup")
    # every block then adds a change of the same size to the stream, which grows with the depth; the
    # width sweep, at the base depth where the multiplier is 1 anyway, still passes
    assert ("depth: layer(last)" in " ".join(failed)
            and not [f for f in failed if f.startswith("width:")])


def test_the_command_writes_its_table_and_exits_by_the_check(tmp_path, capsys):
    argv = [*DENSE, *OPTIONS]
    assert coord_check.main([*argv, "model.parameterization=mup", f"out={tmp_path / 'mup'}"]) == 0
    table = (tmp_path / "mup" / "table.md").read_text()
    assert "## Against width" in table and "## Against depth" in table and "FAIL" not in table
    # one block's last block is its first: the last block's row has no depth-1 value
    assert "| attention(last) | - |" in table and "| logits | - |" not in table
    assert coord_check.main([*argv, "model.parameterization=sp", f"out={tmp_path / 'sp'}"]) == 1
    assert "FAIL" in (tmp_path / "sp" / "table.md").read_text()
    assert "coordinate check FAILED" in capsys.readouterr().err
    assert coord_check.main([*argv, "widths=1"]) == 2  # one width gives no slope
    assert coord_check.main([*argv, "depths=1,2"]) == 2  # the last block's: one depth from 2 on

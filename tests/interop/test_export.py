"""Interop: scalevec_train.load, export to transformers (stock Llama and remote code), import from a
Hugging Face Llama, and clear errors on damaged inputs. References: transformers' own
implementations (LlamaForCausalLM, the exported remote code run by transformers), SentencePiece's
encoder, and the trainer's checkpoint loader."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from scalevec_train import export as export_cli
from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.checkpoint.manager import CheckpointManager, ModelState, OptimizerState
from scalevec_train.data import tokenizer as sp_tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.interop import hf_export as export
from scalevec_train.interop.api import load
from scalevec_train.interop.hf_import import check_init_from, import_llama, init_from_hf
from scalevec_train.model import Transformer
from scalevec_train.model.config import ScaleConfig
from scalevec_train.model.fold import fold
from scalevec_train.model.strategies import scale_sites
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.run.build import build
from scalevec_train.train import run
from tests.support.helpers import SHORT_RUN, make_config_shared
from tests.support.presets import TINY_MODEL

TINY = [*TINY_MODEL, *SHORT_RUN, "train.steps=30", "train.log_every=30", "optim.lr=1e-2"]
# the model random_llama() writes
RANDOM_LLAMA = [*TINY_MODEL, "model.ffn_dim=48", "model.vocab_size=300", "model.max_seq_len=128",
                "model.norm_eps=1e-5", "model.rope_theta=5000", "model.tie_embeddings=false",
                "train.seq_len=64"]
MOE = ["model=moe-tiny", "model.moe.num_experts=4", "model.moe.expert_dim=32", "model.ffn_dim=32"]
# mup with a base half as wide, one block deep and half the head width: every multiplier is not 1
MUP = ["model.parameterization=mup", "model.base_dim=16", "model.base_layers=1",
       "model.base_head_dim=4"]
RUNS = {"baseline": ["scale=baseline"], "unified": ["scale=unified"], "none": ["scale=none"],
        "moe-unified": [*MOE, "scale=unified"], "mup-baseline": [*MUP, "scale=baseline"],
        "mup-moe-unified": [*MOE, *MUP, "scale=unified"]}
SAMPLE = ("def f(x):\n\tif x:\n        return x  +  12345  # größer als 日本語 🙂\r\n\n"
          "    </s> <unk> trailing spaces   \n\u00a0\u2581x")
UNIFIED = ScaleConfig(name="unified", heterogeneity="per_branch", placement="dual_norm",
                      reparam="or", weight_decay="iwd")
STRATEGIES = {"baseline": ScaleConfig(), "hg": ScaleConfig(name="hg", heterogeneity="per_branch"),
              "or": ScaleConfig(name="or", reparam="or"),
              "none": ScaleConfig(name="none", reparam="fixed")}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(data_overrides, tmp_path_factory) -> dict[str, Path]:
    """Run directories trained 30 steps: dense under baseline, unified, none; MoE under unified."""
    root = tmp_path_factory.mktemp("export_runs")
    return {name: run(make_config_shared(*data_overrides, *TINY, *extra, f"run_dir={root / name}"))
            for name, extra in RUNS.items()}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def token_batch(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(seed))


# --- load ----------------------------------------------------------------------------------------

def test_load_gives_the_checkpoint_the_trainer_resumes_from(runs):
    """A second code path: the trainer's own checkpoint loader, into a model and optimizer."""
    run_dir = runs["unified"]
    model, tokenizer = load(run_dir)
    assert isinstance(model, torch.nn.Module) and not model.training
    assert tokenizer.encode("def f(x):") and tokenizer.get_piece_size() <= model.cfg.vocab_size
    cfg = make_config_shared(*TINY, "scale=unified", "model.vocab_size=512")
    reference = Transformer(cfg.model, cfg.scale)
    reference.init_weights(seed=123)
    path = checkpoint_files.complete_checkpoints(run_dir)[-1]
    optimizer = build_optimizer(reference, cfg.optim)
    CheckpointManager(run_dir, {"model": ModelState(reference),
                                "optim": OptimizerState(reference, optimizer)}, records={}, info={},
                      keep_last=1).load(path, checkpoint_files.read_train_state(path))
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    fresh = Transformer(cfg.model, cfg.scale)
    fresh.init_weights(seed=cfg.seed)
    # it trained
    assert not torch.equal(fresh.layers[0].attn.wq.weight, model.layers[0].attn.wq.weight)


def test_load_from_a_checkpoint_dir_and_folded(runs):
    run_dir = runs["baseline"]
    model, _ = load(run_dir)
    step_dir = checkpoint_files.complete_checkpoints(run_dir)[-1]
    folded, _ = load(step_dir, fold=True)
    ids = token_batch(model.cfg.vocab_size)
    torch.testing.assert_close(logits(folded, ids), logits(model, ids), rtol=0, atol=1e-5)
    assert folded.head is not None and model.head is None  # folding the final scale untied the head


# --- export --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["baseline", "unified", "none", "mup-baseline", "mup-moe-unified"])
def test_export_loads_in_transformers_with_the_same_logits(runs, tmp_path, transformers, name):
    out = tmp_path / "hf"
    assert export_cli.main([str(runs[name]), f"out={out}"]) == 0
    model, tokenizer = load(runs[name])
    config = json.loads((out / "config.json").read_text())
    # these fold into a plain Llama, mup's multipliers too
    stock = name in ("baseline", "none", "mup-baseline")
    assert config["architectures"] == (["LlamaForCausalLM"] if stock else ["ScalevecForCausalLM"])
    assert (out / export.MODELING_FILE).exists() != stock
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=not stock).eval()
    assert type(hf).__name__ == config["architectures"][0]
    if stock:
        assert isinstance(hf, transformers.LlamaForCausalLM)
    ids = token_batch(model.cfg.vocab_size)
    torch.testing.assert_close(logits(hf, ids), logits(model, ids), rtol=0, atol=1e-4)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=not stock)
    assert hf_tokenizer.encode(SAMPLE) == tokenizer.encode(SAMPLE)


def test_moe_export_routes_like_scalevec(runs, tmp_path, transformers):
    model, tokenizer = load(runs["moe-unified"])
    ids = token_batch(model.cfg.vocab_size)
    unbiased = logits(model, ids)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.ffn.expert_bias.copy_(torch.randn(4, generator=torch.Generator().manual_seed(i)))
    want = logits(model, ids)
    assert (want - unbiased).abs().max() > 1e-3  # the bias changes which experts are chosen
    out = export.export_model(model, tokenizer, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["moe"]["num_experts"] == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    torch.testing.assert_close(logits(hf, ids), want, rtol=0, atol=1e-4)


def test_remote_code_generates_and_handles_padding(runs, tmp_path, transformers):
    model, tokenizer = load(runs["unified"])
    out = export.export_model(model, tokenizer, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    prompt = torch.tensor([tokenizer.encode("def main(")])
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                            do_sample=False)
    expected = prompt
    for _ in range(5):
        expected = torch.cat([expected, logits(model, expected)[:, -1:].argmax(-1)], dim=1)
    assert generated.tolist() == expected.tolist()
    ids = token_batch(model.cfg.vocab_size)[:1, :10]
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(ids)], dim=1)
    with torch.no_grad():
        left = hf(padded, attention_mask=mask).logits[:, 4:]
    torch.testing.assert_close(left, logits(model, ids), rtol=0, atol=1e-4)


LAYOUTS = {
    "dense-every-output-norm": ["model.qk_norm=true", "model.post_norm=true", "scale=dnp",
                                "scale.targets=[q,k,v,o,gate,up,down]",
                                "scale.head_site_shape=full", "scale.reparam=er"],
    "dense-weightless-qk-norm": ["model.qk_norm=true", "scale=none"],
    "moe-per-expert-dual": [*MOE, "scale=hg", "scale.per_expert=true", "scale.placement=dual",
                            "scale.targets=[q,k,o,gate,up,down]", "model.moe.score_func=sigmoid",
                            "model.moe.renormalize=false", "model.moe.num_shared_experts=2",
                            "model.moe.shared_expert_dim=16"],
    "moe-post-norm-unified": [*MOE, "model.post_norm=true", "scale=unified"],
    # dual_norm's norm over v's whole output beside the model's per-head QK-norm (scale.qkv_norm)
    "dense-qkv-norm-full": ["model.qk_norm=true", "scale=unified", "scale.qkv_norm=full"],
}


def assert_export_parity(overrides: list[str], runs, out: Path, transformers) -> bool:
    """An untrained model with every scale parameter and expert bias drawn at random, exported,
    gives the same logits in transformers; returns whether it exported as a stock Llama."""
    cfg = make_config_shared(*TINY, "model.vocab_size=512", *overrides)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, site in scale_sites(model):
            for p in site.parameters():
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    tokenizer = spm.SentencePieceProcessor(model_file=str(runs["baseline"] / "tokenizer.model"))
    out = export.export_model(model, tokenizer, out)
    config = json.loads((out / "config.json").read_text())
    stock = config["architectures"] == ["LlamaForCausalLM"]
    # the plan the remote code builds its norms from: a row per site of the folded model
    if not stock:
        assert ([row["site"] for row in config["scale_plan"]]
                == [path for path, _ in scale_sites(fold(model))])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=not stock).eval()
    ids = token_batch(512)
    torch.testing.assert_close(logits(hf, ids), logits(model, ids), rtol=0, atol=1e-4)
    return stock


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_remote_code_covers_every_site_layout(runs, tmp_path, transformers, layout):
    assert not assert_export_parity(LAYOUTS[layout], runs, tmp_path / "hf", transformers)


PRESETS = ["none", "baseline", "iwd", "wd_all", "hg", "dp", "dnp", "or", "er", "unified"]


@pytest.mark.parametrize("reading", ["rev2", "rev1"])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_exports_with_the_same_logits(runs, tmp_path, transformers, preset, reading):
    """Both placement readings (revision 2's pre-norm maps, revision 1's q, k, o, down), dense and
    MoE. Stock Llama exactly where nothing is normalized (a dense model); an MoE model always needs
    the remote code."""
    extra = [f"scale={preset}"] + (["scale.targets=[q,k,o,down]"] if reading == "rev1" else [])
    stock = assert_export_parity(extra, runs, tmp_path / "dense", transformers)
    assert stock == (preset not in ("dnp", "unified"))
    assert not assert_export_parity([*MOE, *extra], runs, tmp_path / "moe", transformers)


def test_exported_tokenizer_encodes_like_sentencepiece(runs, corpus_dir, tmp_path, transformers):
    _, tokenizer = load(runs["baseline"])
    export.write_tokenizer(tokenizer, tmp_path, 1024)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = [SAMPLE] + [p.read_text() for p in sorted(corpus_dir.iterdir())]
    for text in texts:
        ids = tokenizer.encode(text)
        assert hf.encode(text) == ids
        assert hf.decode(ids) == tokenizer.decode(ids)
    assert hf.eos_token_id == tokenizer.eos_id()


def test_unigram_tokenizer_converts_too(corpus_dir, tmp_path, transformers):
    lines = sp_tokenizer.training_lines((p.read_text() for p in sorted(corpus_dir.iterdir())),
                                        150_000)
    sp_tokenizer.train(lines, 400, "unigram", tmp_path / "uni.model")
    tokenizer = spm.SentencePieceProcessor(model_file=str(tmp_path / "uni.model"))
    export.write_tokenizer(tokenizer, tmp_path, 1024)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in [SAMPLE, (corpus_dir / "enum.py").read_text()]:
        assert hf.encode(text) == tokenizer.encode(text)


def test_tokenizer_with_another_normalization_is_refused(corpus_dir, tmp_path, transformers):
    # SentencePiece's defaults: nmt_nfkc
    spm.SentencePieceTrainer.train(input=str(corpus_dir / "enum.py"),
                                   model_prefix=str(tmp_path / "nfkc"),
                                   vocab_size=300, minloglevel=2)
    tokenizer = spm.SentencePieceProcessor(model_file=str(tmp_path / "nfkc.model"))
    with pytest.raises(ScalevecError, match="nmt_nfkc.*add_dummy_prefix.*remove_extra_whitespaces"):
        export.write_tokenizer(tokenizer, tmp_path, 1024)


def test_export_refuses_a_non_empty_folder(runs, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert export_cli.main([str(runs["baseline"]), f"out={tmp_path}"]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert export_cli.main([str(runs["baseline"])]) == 2
    assert "usage" in capsys.readouterr().err


# --- import --------------------------------------------------------------------------------------

def random_llama(transformers, folder: Path, tied: bool, vocab: int = 300) -> object:
    """A random transformers Llama whose norms carry non-trivial weights, saved to `folder`."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      rms_norm_eps=1e-5, rope_theta=5000.0,
                                      tie_word_embeddings=tied)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if name.endswith("norm.weight")
                    else 0.1 * torch.randn(p.shape))
    hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_imported_llama_computes_the_hf_function(tmp_path, transformers, tied):
    hf = random_llama(transformers, tmp_path, tied)
    ids = token_batch(300)
    want = logits(hf, ids)
    for name, scale in STRATEGIES.items():
        model = import_llama(tmp_path, scale).eval()
        assert model.cfg.rope_theta == 5000.0 and model.cfg.norm_eps == 1e-5
        torch.testing.assert_close(logits(model, ids), want, rtol=0, atol=1e-4, msg=name)
        # Norm weights go into the matrices where no single plain site can take them: those sites
        # start at 1.
        if name == "or":
            assert all(torch.equal(site(), torch.ones(site.shape))
                       for _, site in scale_sites(model))
        if name == "hg":
            assert all(torch.equal(site(), torch.ones(32))
                       for site in model.layers[0].attn_norm.sites.values())


def test_imported_llama_trains_under_unified(tmp_path, transformers):
    random_llama(transformers, tmp_path, tied=False)
    model = import_llama(tmp_path, UNIFIED)
    cfg = make_config_shared("scale=unified")
    optimizer = build_optimizer(model, cfg.optim)
    ids = token_batch(300)
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                                 ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_init_from_hf_checks_the_config(tmp_path, transformers):
    hf = random_llama(transformers, tmp_path, tied=False)
    cfg = make_config_shared(*RANDOM_LLAMA, "scale=hg")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed=0)
    init_from_hf(model, tmp_path)
    ids = token_batch(300)
    torch.testing.assert_close(logits(model.eval(), ids), logits(hf, ids), rtol=0, atol=1e-4)
    with torch.device("meta"):  # the check runs before the model is materialized
        wrong = Transformer(make_config_shared(*TINY, "model.vocab_size=300").model, cfg.scale)
    with pytest.raises(ScalevecError, match=r"model\.ffn_dim=64 but the checkpoint has 48"):
        check_init_from(wrong, tmp_path)


def test_init_from_hf_fills_fsdp_shards(tmp_path, transformers):
    """FSDP2 on a one-rank gloo group: the parameters are DTensors, as under torchrun."""
    hf = random_llama(transformers, tmp_path, tied=False)
    cfg = make_config_shared(*RANDOM_LLAMA)
    # a file store, not a port picked here and bound later: another process may take it in between
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = Transformer(cfg.model, cfg.scale)
        model.init_weights(seed=0)
        mesh = init_device_mesh("cpu", (1,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model.layers[0].attn.wq.weight).__name__ == "DTensor"
        init_from_hf(model, tmp_path)
        ids = token_batch(300)
        torch.testing.assert_close(logits(model.eval(), ids), logits(hf, ids), rtol=0, atol=1e-4)
    finally:
        dist.destroy_process_group()


def test_training_run_starts_from_init_from(data_overrides, tmp_path, transformers):
    """`init_from=` in a run's config: step 0 computes the Hugging Face function; a bad folder fails
    before anything is written; a resumed run keeps its own weights."""
    hf = random_llama(transformers, tmp_path / "hf", tied=False, vocab=512)
    overrides = [*data_overrides, *TINY, "model.ffn_dim=48", "model.norm_eps=1e-5",
                 "model.rope_theta=5000", "model.tie_embeddings=false", "scale=hg",
                 f"run_dir={tmp_path / 'run'}"]
    trainer = build(make_config_shared(*overrides, f"init_from={tmp_path / 'hf'}")).trainer
    ids = token_batch(512)
    torch.testing.assert_close(logits(trainer.model.eval(), ids), logits(hf, ids), rtol=0,
                               atol=1e-4)

    with pytest.raises(ScalevecError, match=r"model\.ffn_dim=64 but the checkpoint has 48"):
        build(make_config_shared(*data_overrides, *TINY, f"run_dir={tmp_path / 'bad'}",
                                 f"init_from={tmp_path / 'hf'}"))
    assert not (tmp_path / "bad").exists()

    run_dir = run(make_config_shared(*overrides, "train.steps=2"))
    trained = logits(load(run_dir)[0], ids)
    resumed = build(make_config_shared(*overrides, "train.steps=4", "resume=auto",
                                       f"init_from={tmp_path / 'hf'}")).trainer
    torch.testing.assert_close(logits(resumed.model.eval(), ids), trained, rtol=0, atol=1e-5)


def test_export_import_export_is_identical(runs, tmp_path, transformers):
    first = tmp_path / "first"
    assert export_cli.main([str(runs["baseline"]), f"out={first}"]) == 0
    model = import_llama(first)  # baseline: the ones of the folded norms go into its sites
    tokenizer = spm.SentencePieceProcessor(model_file=str(first / "tokenizer.model"))
    second = export.export_model(model, tokenizer, tmp_path / "second")
    a, b = load_file(first / export.WEIGHTS_FILE), load_file(second / export.WEIGHTS_FILE)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for file in ("tokenizer.json", "tokenizer.model"):
        assert (first / file).read_bytes() == (second / file).read_bytes()


# --- damaged and mismatched inputs ---------------------------------------------------------------

@pytest.fixture
def run_copy(runs, tmp_path) -> tuple[Path, Path]:
    """A copy of the baseline run directory and its checkpoint, to damage."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["baseline"], run_dir)
    return run_dir, checkpoint_files.complete_checkpoints(run_dir)[-1]


def truncate_shard(run_dir: Path, step: Path) -> None:
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # into the model tensors, which come first


def remove(name: str):
    return lambda run_dir, step: (step / name).unlink()


def edit_config(old: str, new: str):
    def damage(run_dir: Path, step: Path) -> None:
        config = run_dir / "config.yaml"
        config.write_text(config.read_text().replace(old, new))
    return damage


DAMAGES = {  # name: (damage, load the run dir or the checkpoint, the message)
    "truncated_shard": (truncate_shard, "run", r"__0_0\.distcp: is truncated"),
    "no_metadata": (remove(".metadata"), "step", r"\.metadata: is missing"),
    "no_complete_marker": (remove(checkpoint_files.COMPLETE), "step", "not a complete checkpoint"),
    "other_shape": (edit_config("ffn_dim: 64", "ffn_dim: 80"), "run",
                    r"layers\.0\.ffn\.w_gate\.weight is \[64, 32\] in the checkpoint"),
    "fewer_layers": (edit_config("n_layers: 2", "n_layers: 3"), "run", r"missing layers\.2\."),
}


@pytest.mark.parametrize("name", DAMAGES)
def test_damaged_or_mismatched_checkpoint_is_named(run_copy, name):
    damage, target, message = DAMAGES[name]
    run_dir, step = run_copy
    damage(run_dir, step)
    with pytest.raises(ScalevecError, match=message):
        load(run_dir if target == "run" else step)


def test_checkpoint_metadata_cannot_run_code(run_copy, tmp_path):
    run_dir, step = run_copy
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (shutil.copyfile, (str(step / checkpoint_files.COMPLETE), str(marker)))

    (step / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(ScalevecError, match=r"\.metadata: is truncated: \d+ bytes, \d+ when it "
                                            r"was written"):
        load(run_dir)
    # read without its checksums (a checkpoint one trusts): the metadata's unpickler refuses the
    # object
    with pytest.raises(ScalevecError, match="unexpected object shutil.copyfile"):
        load(run_dir, verify=False)
    assert not marker.exists()


def test_damaged_hf_folders_are_named(tmp_path, transformers):
    random_llama(transformers, tmp_path / "good", tied=False)
    weights = load_file(tmp_path / "good" / "model.safetensors")

    truncated = shutil.copytree(tmp_path / "good", tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ScalevecError, match=r"model\.safetensors: is not a readable "
                                            r"safetensors file"):
        import_llama(truncated)

    missing = shutil.copytree(tmp_path / "good", tmp_path / "missing")
    save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k},
              missing / "model.safetensors")
    with pytest.raises(ScalevecError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        import_llama(missing)

    shapes = shutil.copytree(tmp_path / "good", tmp_path / "shapes")
    config = json.loads((shapes / "config.json").read_text())
    (shapes / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(ScalevecError, match=r"mlp\.gate_proj\.weight in model\.safetensors is "
                                            r"\[48, 32\], expected \[40, 32\]"):
        import_llama(shapes)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tmp_path / "good" / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ScalevecError, match="pickle"):
        import_llama(pickled)


def test_transformers_is_not_imported_by_the_package():
    """transformers is optional: only the export/import functions that need it import it."""
    code = ("import sys, scalevec_train.interop.api, scalevec_train.interop.hf_export, "
            "scalevec_train.interop.hf_import; "
            "sys.exit(int('transformers' in sys.modules or 'tokenizers' in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0

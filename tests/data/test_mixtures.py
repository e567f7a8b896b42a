"""Weighted data mixtures (data.mixture): the shares of the sources against the weights (binomial
tolerance), each source's samples in its own permutation order, resume on another world size (in
process and on real gloo ranks), the per-source validation losses against a direct computation with
plain PyTorch, the repeat warning, and bad configs. Two small text folders, written here."""

import inspect
import json
import math
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scalevec_train.data import DataConfig, TokenLoader, prepare_data
from scalevec_train.data.config import MixtureSource
from scalevec_train.data.loader import Loader
from scalevec_train.data.mixing import BLOCK, SourceSchedule
from scalevec_train.data.mixture import MixtureData
from scalevec_train.data.mixture_loader import MixtureLoader
from scalevec_train.data.permutation import permute
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.training.callbacks import EpochMonitor
from tests.support.corpora import VOCAB, split_tokens, text_cfg, write_corpus
from tests.support.helpers import make_config
from tests.support.launch import records, train_spawned
from tests.support.presets import TINY_MODEL

SEQ = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("folders")
    write_corpus(root / "a", n_docs=20, seed=1)
    write_corpus(root / "b", n_docs=5, seed=2)
    return root / "a", root / "b"


def mixture_cfg(folders, cache: Path, weights=(0.75, 0.25), **entry_b) -> DataConfig:
    a, b = folders
    return replace(text_cfg(a, cache), source="stdlib", path="", mixture=[
        MixtureSource(name="a", source="text_dir", path=str(a), weight=weights[0],
                      val_fraction=0.2),
        MixtureSource(name="b", source="text_dir", path=str(b), weight=weights[1], val_fraction=0.2,
                      **entry_b)])


@pytest.fixture(scope="module")
def mixture(folders, tmp_path_factory) -> MixtureData:
    return prepare_data(mixture_cfg(folders, tmp_path_factory.mktemp("cache")))


def windows_of(mixture: MixtureData) -> dict[tuple, tuple[int, int]]:
    """(source, window) of every training window of the sources, by its seq_len + 1 tokens."""
    out = {}
    for k, (_, data) in enumerate(mixture.sources):
        tokens = split_tokens(data, "train")
        for w in range((tokens.size - 1) // SEQ):
            out[tuple(tokens[w * SEQ: w * SEQ + SEQ + 1].tolist())] = (k, w)
    return out


def drawn(mixture: MixtureData, batches) -> list[tuple[int, int]]:
    """(source, window) of every row of `batches`, found by its tokens."""
    known = windows_of(mixture)
    return [known[tuple(x.tolist()) + (int(y[-1]),)] for b in batches
            for x, y in zip(b.inputs, b.targets)]


def test_sources_share_one_tokenizer(mixture):
    assert [e.name for e, _ in mixture.sources] == ["a", "b"]
    assert len({d.tokenizer_hash for _, d in mixture.sources}) == 1
    assert mixture.tokenizer_path.read_bytes() == mixture.sources[1][1].tokenizer_path.read_bytes()


def test_shares_follow_the_weights_and_each_source_its_own_order(mixture):
    """2,000 samples of a 0.75/0.25 mixture: source a's count within 3 binomial standard deviations
    of 1,500, and each source's rows, in sample order, are the windows its own permutation gives."""
    n = 2000
    loader = MixtureLoader(mixture, SEQ, 50, seed=3)
    samples = drawn(mixture, [loader.next_batch() for _ in range(n // 50)])
    assert abs(sum(k == 0 for k, _ in samples) - 0.75 * n) < 3 * math.sqrt(n * 0.75 * 0.25)
    for k, (_, data) in enumerate(mixture.sources):
        count = (split_tokens(data, "train").size - 1) // SEQ
        j = np.arange(sum(s == k for s, _ in samples))
        assert j.size > count  # each source wraps into its second epoch
        expected = np.concatenate([permute(j[j // count == e] % count, count, 3, e)
                                   for e in np.unique(j // count)])
        assert [w for s, w in samples if s == k] == expected.tolist()


def test_resume_on_another_world_size_draws_the_same_samples(mixture):
    """Uninterrupted on one rank vs 3 steps on one rank then 2 ranks, then 4: the same rows."""
    single = MixtureLoader(mixture, SEQ, 8, seed=5)
    expected = [single.next_batch() for _ in range(9)]
    first = MixtureLoader(mixture, SEQ, 8, seed=5)
    got = [first.next_batch() for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    pair = [MixtureLoader(mixture, SEQ, 4, seed=5, rank=r, world_size=2) for r in range(2)]
    for p in pair:
        p.load_state_dict(state)
    got += [SimpleNamespace(inputs=torch.cat([p.next_batch().inputs for p in pair]))
            for _ in range(3)]
    quad = [MixtureLoader(mixture, SEQ, 2, seed=5, rank=r, world_size=4) for r in range(4)]
    for q in quad:
        q.load_state_dict(pair[1].state_dict())
    got += [SimpleNamespace(inputs=torch.cat([q.next_batch().inputs for q in quad]))
            for _ in range(3)]
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a.inputs, b.inputs)


def test_resume_rejects_another_mixture(folders, mixture, tmp_path):
    state = MixtureLoader(mixture, SEQ, 8, seed=0).state_dict()
    other = prepare_data(mixture_cfg(folders, tmp_path, weights=(0.5, 0.5)))
    with pytest.raises(ScalevecError, match=r"data loader state \(mixture\)"):
        MixtureLoader(other, SEQ, 8, seed=0).load_state_dict(state)
    with pytest.raises(ScalevecError, match="seed"):
        MixtureLoader(mixture, SEQ, 8, seed=1).load_state_dict(state)


def test_a_single_source_draws_what_it_drew_before_mixtures(folders, tmp_path):
    """The single-source order is pinned (permutation values written down on main before mixtures),
    and a mixture of that one source with its tokenizer draws exactly the single-source
    loader's rows."""
    assert permute(np.arange(8), 1000, 0, 0).tolist() == [414, 540, 67, 159, 765, 99, 686, 267]
    assert permute(np.arange(4), 1000, 7, 2).tolist() == [217, 821, 17, 699]
    single = prepare_data(text_cfg(folders[0], tmp_path, val_fraction=0.2))
    entry = MixtureSource(name="a", source="text_dir", path=str(folders[0]), val_fraction=0.2)
    alone = prepare_data(replace(text_cfg(folders[0], tmp_path), source="stdlib", path="",
                                 tokenizer_path=str(single.tokenizer_path), mixture=[entry]))
    assert alone.first.root == single.root
    plain, mixed = (TokenLoader(single, "train", SEQ, 8, seed=2),
                    MixtureLoader(alone, SEQ, 8, seed=2))
    # both are what the trainer takes (data/loader.py, Loader), signatures and all
    for loader in (plain, mixed):
        assert isinstance(loader, Loader)
        for name in ("next_batch", "epochs_at", "state_dict", "load_state_dict"):
            expected = list(inspect.signature(getattr(Loader, name)).parameters)[1:]
            assert list(inspect.signature(getattr(loader, name)).parameters) == expected, name
    for _ in range(2 * BLOCK // 8 + 3):  # across block boundaries and into the second epoch
        a, b = plain.next_batch(), mixed.next_batch()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def test_the_schedule_deals_exact_shares_per_cycle_of_blocks():
    """Over BLOCK blocks each source holds its weight's share to within one sample per block
    boundary, and counts() agrees with assign() everywhere."""
    schedule = SourceSchedule([0.3, 0.3001, 0.0005, 0.3994], seed=1)
    n = BLOCK * BLOCK
    assert np.all(np.abs(schedule.counts(n) - n * np.array([0.3, 0.3001, 0.0005, 0.3994])) <= 2)
    samples = np.arange(3 * BLOCK + 100)
    sources, local = schedule.assign(samples)
    for k in range(4):
        assert local[sources == k].tolist() == list(range(int((sources == k).sum())))
    assert schedule.counts(samples.size).tolist() == np.bincount(sources, minlength=4).tolist()


def test_max_tokens_caps_a_source_and_repeats_are_warned_per_source(folders, tmp_path, capsys):
    data = prepare_data(mixture_cfg(folders, tmp_path, max_tokens=400))
    loader = MixtureLoader(data, SEQ, 50, seed=0)
    assert loader.sources[1][1].num_windows == (400 - 1) // SEQ
    rows = drawn(data, [loader.next_batch() for _ in range(10)])
    assert {w for k, w in rows if k == 1} == set(range((400 - 1) // SEQ))  # the cap, and all of it
    # 800 samples, 200 of b
    trainer = SimpleNamespace(loader=loader, schedule=SimpleNamespace(steps=100),
                              recipe=SimpleNamespace(tokens_per_step=8 * SEQ))
    EpochMonitor(max_repeats=4.0).on_fit_start(trainer)
    err = capsys.readouterr().err
    assert "source 'b' of the mixture" in err and "source 'a'" not in err
    assert loader.epochs_at(800)["b"] == pytest.approx(loader.schedule.counts(800)[1] / 24)


BAD = [
    ({"name": "val/x"}, "data.mixture[1].name", "cannot name a metric"),
    ({"name": ""}, "data.mixture[1].name", "cannot name a metric"),
    ({"name": "a"}, "data.mixture[1].name", "names two sources"),
    ({"weight": 0.0}, "data.mixture[1].weight", "not a positive number"),
    ({"weight": float("nan")}, "data.mixture[1].weight", "not a positive number"),
    ({"max_tokens": -1}, "data.mixture[1].max_tokens", "negative"),
    ({"path": ""}, "data.mixture[1].path", "needs a path"),
    ({"source": "web"}, "data.mixture[1].source", "unknown value"),
    ({"source": "shards"}, "data.mixture[1].source", "data.tokenizer_path"),
    ({"val_fraction": 1.5}, "data.mixture[1].val_fraction", "outside"),
]


@pytest.mark.parametrize("change,where,problem", BAD,
                         ids=[w.split(".")[-1] + "-" + p for _, w, p in BAD])
def test_bad_mixtures_name_the_entry_and_the_problem(folders, tmp_path, change, where, problem):
    cfg = mixture_cfg(folders, tmp_path)
    cfg.mixture[1] = replace(cfg.mixture[1], **change)
    with pytest.raises(ScalevecError, match="Fix: ") as err:
        cfg.validate()
    assert err.value.where == where and problem in err.value.problem


def test_a_mixture_with_a_single_source_path_is_an_error(folders, tmp_path):
    with pytest.raises(ScalevecError, match="data.mixture: is set, and so is data.source=text_dir"):
        replace(mixture_cfg(folders, tmp_path), source="text_dir", path=str(folders[0])).validate()


def test_the_mixture_preset_composes(tmp_path):
    cfg = make_config("data=mixture", "data.mixture.1.weight=0.5")
    assert [(m.name, m.source, m.weight) for m in cfg.data.mixture] == [("code", "stdlib", 0.75),
                                                                       ("docs", "text_dir", 0.5)]


def test_array_tasks_prepare_each_source_as_one_process_does(folders, tmp_path, monkeypatch,
                                                             capsys):
    """A mixture prepared by 2 SLURM array tasks (in reverse order; parts of 2 KB, so each task
    encodes some of each source) is byte for byte the one-process preparation,
    tokenizer included."""
    from scalevec_train import prepare_data as prepare_cli
    from tests.support.corpora import folder_bytes

    small = {"part_bytes": 2000, "shard_tokens": 500}
    one = prepare_data(replace(mixture_cfg(folders, tmp_path / "one"), **small))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    overrides = [f"model.vocab_size={VOCAB}", f"data.cache_dir={tmp_path / 'two'}",
                 "data.num_workers=1", "data.part_bytes=2000", "data.shard_tokens=500",
                 f"data.mixture=[{{name:a,source:text_dir,path:'{folders[0]}',"
                 "weight:0.75,val_fraction:0.2},"
                 f"{{name:b,source:text_dir,path:'{folders[1]}',weight:0.25,val_fraction:0.2}}]"]
    for task, message in (("1", "process 1 of 2: its parts are written"), ("0", "(source b)")):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
        assert prepare_cli.main(overrides) == 0
        assert message in capsys.readouterr().out
    for _, data in one.sources:
        assert folder_bytes(tmp_path / "two" / data.root.name) == folder_bytes(data.root)


# --- training runs --------------------------------------------------------------------------------
TINY = ["model=dense-tiny", *TINY_MODEL, f"model.vocab_size={VOCAB}", "train.seq_len=32",
        "train.global_batch=8", "train.micro_batch=4", "train.steps=6", "train.eval_every=3",
        "train.eval_batches=1", "train.log_every=1", "checkpoint.every=3",
        "schedule.warmup_steps=1", "device=cpu", "data.num_workers=1", "logger.progress_bar=false"]


def run_overrides(folders, cache: Path) -> list[str]:
    a, b = folders
    return [*TINY, f"data.cache_dir={cache}",
            f"data.mixture=[{{name:a,source:text_dir,path:'{a}',weight:0.75,val_fraction:0.2}},"
            f"{{name:b,source:text_dir,path:'{b}',weight:0.25,val_fraction:0.2}}]"]


def curve_of(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


def test_resumed_on_1_and_2_ranks_and_per_source_val_losses(folders, tmp_path):
    """A mixture run of 6 steps, against the same run resumed from its step-3 checkpoint by the
    trainer on 1 and on 2 gloo ranks (tests/support/train_many.py on spawned ranks): the same losses
    (so the same samples) and validation losses per source. Each source's val_loss/<name> equals its
    validation batches' mean cross-entropy under the final model, computed here with plain PyTorch,
    and val_loss is their 0.75/0.25 weighted mean."""
    from scalevec_train.checkpoint import files as checkpoint_files
    from scalevec_train.data.sources import validation_batches
    from scalevec_train.interop.api import load
    from scalevec_train.run.checkpoint_eval import evaluate
    from scalevec_train.train import run

    overrides = run_overrides(folders, tmp_path / "cache")
    reference = run(make_config(*overrides, f"run_dir={tmp_path / 'one'}"))
    for world in (1, 2):
        resumed = tmp_path / f"resumed{world}"
        shutil.copytree(reference, resumed)
        for ckpt in (resumed / "checkpoints").glob("step_*"):
            if int(ckpt.name.split("_")[1]) > 3:
                shutil.rmtree(ckpt)
        (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                       for r in records(reference)
                                                       if r["step"] <= 3))
        train_spawned(world, [[*overrides, f"run_dir={resumed}", "resume=auto"]],
                      tmp_path / f"resumed{world}.json")
        for key in ("loss", "val_loss", "val_loss/a", "val_loss/b"):
            got, expected = curve_of(resumed, key), curve_of(reference, key)
            assert got.keys() == expected.keys() and len(got) >= 3, key
            for step in got:
                assert got[step] == pytest.approx(expected[step], rel=1e-5), (world, key, step)
        assert checkpoint_files.read_train_state(
            checkpoint_files.step_dir(resumed, 6))["world_size"] == world

    cfg = make_config(*overrides, f"run_dir={reference}")
    model, _ = load(checkpoint_files.step_dir(reference, 6))
    final = {r["step"]: r for r in records(reference)}[6]
    t = cfg.train
    sets = validation_batches(prepare_data(cfg.data), t.seq_len, t.micro_batch,
                              t.eval_batches * t.global_batch, 0, 1,
                              cfg.model.attention_mask == "document")
    with torch.no_grad():
        direct = {name: float(np.mean([F.cross_entropy(model(b.inputs).flatten(0, 1),
                                                       b.targets.flatten()).item()
                                       for b in batches])) for name, batches in sets.items()}
    assert final["val_loss/a"] == pytest.approx(direct["a"], rel=1e-5)
    assert final["val_loss/b"] == pytest.approx(direct["b"], rel=1e-5)
    assert direct["a"] != pytest.approx(direct["b"], rel=1e-3)
    assert final["val_loss"] == pytest.approx(0.75 * direct["a"] + 0.25 * direct["b"], rel=1e-5)
    assert {"val_bpb/a", "val_bpb/b", "epochs/a", "epochs/b"} <= final.keys()
    # the evaluate command on the final checkpoint: the trainer's validation numbers at that step
    evaluated, _ = evaluate(reference)
    assert (evaluated.keys()
            == {"val_loss", "val_bpb", "val_loss/a", "val_loss/b", "val_bpb/a", "val_bpb/b"})
    for key, value in evaluated.items():
        assert value == pytest.approx(final[key], rel=1e-5), key

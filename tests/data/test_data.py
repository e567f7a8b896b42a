"""Data pipeline: preparation and its cache, bad-data errors, and the deterministic,
resumable loader.

References are independent of the code under test where possible: shard files are read with
np.fromfile, documents are compared with the files they came from, and loader rows with slices of
that directly read stream.
"""

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from scalevec_train.data import DataConfig, PreparedData, TokenLoader, check_vocab, prepare_data
from scalevec_train.data import parts as parts_module
from scalevec_train.data import prepare as prepare_module
from scalevec_train.data.corpus import open_corpus
from scalevec_train.data.permutation import permute
from scalevec_train.data.shards import ShardWriter
from scalevec_train.infra.errors import ScalevecError
from tests.support.corpora import (
    VOCAB,
    folder_bytes,
    split_texts,
    split_tokens,
    text_cfg,
    write_corpus,
)
from tests.support.helpers import REPO, hide_package

CONFIGS = REPO / "configs"


def copy_prepared(data: PreparedData, dest: Path) -> Path:
    shutil.copytree(data.root, dest)
    return dest


def shards_cfg(path: Path, **overrides) -> DataConfig:
    return DataConfig(**{"source": "shards", "path": str(path), "vocab_size": VOCAB, **overrides})


# --- preparation ----------------------------------------------------------------------------------


def test_splits_hold_every_document_once_in_corpus_order(prepared, corpus):
    _, docs = corpus
    train, val = split_texts(prepared, "train"), split_texts(prepared, "val")
    assert sorted(train + val) == sorted(docs.values())
    assert len(val) == round(0.2 * len(docs))
    walk_order = [docs[k] for k in sorted(docs, key=lambda rel: (rel.count("/"), rel))]
    assert train == [t for t in walk_order if t in train]
    for split, texts in (("train", train), ("val", val)):
        m = prepared.manifest[split]
        assert (m["dtype"], m["vocab_size"], m["num_documents"]) == ("uint16", VOCAB, len(texts))
        assert m["num_tokens"] == split_tokens(prepared, split).size
        assert m["tokenizer_hash"] == prepared.tokenizer_hash
    assert len(prepared.manifest["train"]["shards"]) > 1


def test_tokenizer_round_trips_code_exactly(prepared):
    sp = prepared.load_tokenizer()
    assert sp.get_piece_size() == VOCAB == prepared.vocab_size
    for text in ("def f(x):\n    return x  # two  spaces\n\n", "\tindented\r\n", "naïve ☃ 😀 ∑\n",
                 "  lead"):
        assert sp.decode(sp.encode(text)) == text
    assert sp.encode("\n") == [sp.piece_to_id("\n")]


def test_max_corpus_bytes_keeps_whole_leading_documents(corpus, tmp_path):
    root, docs = corpus
    walk_order = sorted(docs, key=lambda rel: (rel.count("/"), rel))
    kept = [docs[k] for k in walk_order[:6]]
    data = prepare_data(text_cfg(root, tmp_path,
                                 max_corpus_bytes=sum(len(t.encode()) for t in kept) + 10,
                                 val_fraction=0.3))
    assert sorted(split_texts(data, "train") + split_texts(data, "val")) == sorted(kept)


def test_cache_hit_rewrites_nothing(corpus, tmp_path, monkeypatch):
    cfg = text_cfg(corpus[0], tmp_path)
    first = prepare_data(cfg)
    files = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}

    def must_not_run(*args, **kwargs):
        raise AssertionError("a cache hit trained or wrote again")

    monkeypatch.setattr(prepare_module, "_build", must_not_run)
    monkeypatch.setattr(prepare_module, "_train_tokenizer", must_not_run)
    second = prepare_data(cfg)
    assert (second.root, second.tokenizer_hash) == (first.root, first.tokenizer_hash)
    assert second.manifest == first.manifest
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == files


def test_changed_corpus_is_prepared_again(tmp_path):
    docs = write_corpus(tmp_path / "corpus")
    cfg = text_cfg(tmp_path / "corpus", tmp_path / "cache")
    before = prepare_data(cfg)
    (tmp_path / "corpus" / "doc01.txt").write_text(docs["doc01.txt"] + "omega omega\n")
    after = prepare_data(cfg)
    assert after.root != before.root
    assert "omega omega" in "".join(split_texts(after, "train") + split_texts(after, "val"))


def test_interrupted_preparation_resumes_from_its_finished_parts(corpus, tmp_path, monkeypatch):
    """Killed while writing its third part: no folder that looks prepared; the next preparation
    encodes only the parts that were not finished, and its result is that of an
    uninterrupted one."""
    cfg = text_cfg(corpus[0], tmp_path / "cache", part_bytes=4000, shard_tokens=700)
    reference = prepare_data(text_cfg(corpus[0], tmp_path / "reference", part_bytes=4000,
                                      shard_tokens=700))
    finish, finished = parts_module.PartWriter.finish, []

    def killed_at_the_third(self):
        if len(finished) == 2:
            raise KeyboardInterrupt
        finish(self)
        finished.append(self.part)

    monkeypatch.setattr(parts_module.PartWriter, "finish", killed_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg)
    assert not [p for p in (tmp_path / "cache").iterdir()
                if not p.name.startswith(".") and p.name != "tokenizers"]
    monkeypatch.undo()
    init, encoded = parts_module.PartWriter.__init__, []

    def recording(self, staging, part, *args):
        encoded.append(part)
        init(self, staging, part, *args)

    monkeypatch.setattr(parts_module.PartWriter, "__init__", recording)
    data = prepare_data(cfg)
    assert finished == [0, 1] and encoded[0] == 2 and len(encoded) > 2
    assert folder_bytes(data.root) == folder_bytes(reference.root)
    assert (sorted(p.name for p in (tmp_path / "cache").iterdir())
            == [".lock", data.root.name, "tokenizers"])


def test_prepared_folder_reads_back_as_shards(prepared, tmp_path):
    again = prepare_data(shards_cfg(copy_prepared(prepared, tmp_path / "copy")))
    assert again.manifest == prepared.manifest and again.tokenizer_hash == prepared.tokenizer_hash
    assert split_texts(again, "val") == split_texts(prepared, "val")


# --- bad data -------------------------------------------------------------------------------------


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "none").mkdir()
    with pytest.raises(ScalevecError, match="empty corpus"):
        prepare_data(text_cfg(tmp_path / "none", tmp_path / "cache"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("\n\n")
    with pytest.raises(ScalevecError, match="empty corpus"):
        prepare_data(text_cfg(tmp_path / "blank", tmp_path / "cache"))


def test_vocab_too_large_for_the_corpus_is_an_error(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("ab ab ab\n")
    with pytest.raises(ScalevecError, match="data.vocab_size"):
        prepare_data(text_cfg(tmp_path, tmp_path / "cache", vocab_size=5000))


def test_token_id_beyond_vocab_is_an_error(prepared, tmp_path):
    folder = copy_prepared(prepared, tmp_path / "copy")
    shard = np.memmap(folder / "train" / prepared.manifest["train"]["shards"][-1]["name"],
                      dtype=np.uint16, mode="r+")
    shard[3] = VOCAB
    shard.flush()
    del shard
    with pytest.raises(ScalevecError, match=f"token id {VOCAB} >= vocab_size={VOCAB}"):
        prepare_data(shards_cfg(folder))
    writer = ShardWriter(tmp_path / "new", VOCAB, shard_tokens=100)
    with pytest.raises(ScalevecError, match=f"id {VOCAB} outside"):
        writer.add(np.array([0, VOCAB - 1, VOCAB]))


def test_tokenizer_mismatch_is_an_error(prepared, corpus, tmp_path):
    other = prepare_data(text_cfg(corpus[0], tmp_path / "cache", vocab_size=VOCAB + 10))
    folder = copy_prepared(prepared, tmp_path / "copy")
    with pytest.raises(ScalevecError, match="was written with tokenizer"):
        prepare_data(shards_cfg(folder, tokenizer_path=str(other.tokenizer_path),
                                vocab_size=VOCAB + 10))
    shutil.copyfile(other.tokenizer_path, folder / "tokenizer.model")
    with pytest.raises(ScalevecError, match="was written with tokenizer"):
        prepare_data(shards_cfg(folder, vocab_size=VOCAB + 10))


def test_manifest_mismatch_is_an_error(prepared, tmp_path):
    folder = copy_prepared(prepared, tmp_path / "copy")
    manifest = json.loads((folder / "val" / "manifest.json").read_text())
    (folder / "val" / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": VOCAB + 1}))
    with pytest.raises(ScalevecError, match="vocab_size"):
        prepare_data(shards_cfg(folder))
    manifest["num_tokens"] += 1
    (folder / "val" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ScalevecError, match="shards add up"):
        prepare_data(shards_cfg(folder))


def test_truncated_shard_is_an_error_also_on_a_cache_hit(corpus, tmp_path):
    cfg = text_cfg(corpus[0], tmp_path, shard_tokens=1000)
    data = prepare_data(cfg)
    shard = data.train_dir / data.manifest["train"]["shards"][0]["name"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ScalevecError, match="is truncated"):
        prepare_data(cfg)


def test_model_vocab_must_cover_the_data(prepared, tmp_path):
    check_vocab(prepared, VOCAB)
    with pytest.raises(ScalevecError, match="model.vocab_size"):
        check_vocab(prepared, VOCAB - 1)
    with pytest.raises(ScalevecError, match="model.vocab_size"):
        prepare_data(shards_cfg(copy_prepared(prepared, tmp_path / "copy"), vocab_size=VOCAB - 1))


@pytest.mark.parametrize(("overrides", "key"), [
    ({"source": "web"}, "data.source"),
    ({"source": "text_dir"}, "data.path"),
    ({"path": "/some/folder"}, "data.path"),
    ({"val_fraction": 0.0}, "data.val_fraction"),
    ({"source": "text_dir", "path": "/no/such/folder"}, "data.path"),
    ({"source": "shards", "path": "/no/such/folder"}, "data.path"),
])
def test_bad_config_names_its_key(overrides, key, tmp_path):
    with pytest.raises(ScalevecError, match=key):
        prepare_data(DataConfig(cache_dir=str(tmp_path), **overrides))


def test_presets_compose_onto_the_dataclass(tmp_path):
    shutil.copytree(CONFIGS / "data", tmp_path / "data")
    (tmp_path / "main.yaml").write_text("defaults:\n  - data: stdlib\n  - _self_\n"
                                        "model:\n  vocab_size: 512\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        for preset in ("stdlib", "python_env", "text_dir", "hf", "shards"):
            raw = OmegaConf.to_container(compose("main", overrides=[f"data={preset}"]),
                                         resolve=True)["data"]
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), raw))
            assert cfg == DataConfig(source=preset, vocab_size=512)


# --- loader ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000])
def test_permutation_is_a_bijection(n):
    for seed, epoch in ((0, 0), (1, 0), (0, 7)):
        assert sorted(permute(np.arange(n), n, seed, epoch).tolist()) == list(range(n))
    if n == 1000:
        orders = [permute(np.arange(n), n, s, e).tolist() for s, e in ((0, 0), (1, 0), (0, 1))]
        assert len({tuple(o) for o in orders} | {tuple(range(n))}) == 4


def test_loader_rows_are_permuted_windows_of_the_stream(prepared):
    tokens = split_tokens(prepared, "train")
    seq_len, batch = 16, 4
    loader = TokenLoader(prepared, "train", seq_len, batch, seed=3)
    n = (tokens.size - 1) // seq_len
    assert loader.num_windows == n
    first_epoch = []
    for step in range(n // batch + 3):
        inputs, targets, _ = loader.next_batch()
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.shape == targets.shape == (batch, seq_len)
        for row in range(batch):
            i = step * batch + row
            window = int(permute(np.array([i % n]), n, 3, i // n)[0])
            ref = torch.from_numpy(tokens[window * seq_len: window * seq_len + seq_len + 1])
            assert torch.equal(inputs[row], ref[:-1]) and torch.equal(targets[row], ref[1:])
            if i < n:
                first_epoch.append(window)
    assert sorted(first_epoch) == list(range(n))
    assert loader.epoch == 1


def test_loader_order_depends_only_on_the_seed(prepared):
    def batches(seed):
        loader = TokenLoader(prepared, "train", 16, 4, seed=seed)
        return torch.cat([loader.next_batch()[0] for _ in range(5)])

    assert torch.equal(batches(0), batches(0))
    assert not torch.equal(batches(0), batches(1))


def test_resume_continues_with_exactly_the_next_batches(prepared):
    loader = TokenLoader(prepared, "train", 16, 4, seed=0)
    for _ in range(7):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch() for _ in range(5)]
    resumed = TokenLoader(prepared, "train", 16, 4, seed=0)
    resumed.load_state_dict(state)
    for (x, y, _), (rx, ry, _) in zip(expected, (resumed.next_batch() for _ in range(5)),
                                      strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_ranks_split_the_global_batch_and_resume_on_another_world_size(prepared):
    single = TokenLoader(prepared, "train", 16, 4, seed=5)
    pair = [TokenLoader(prepared, "train", 16, 2, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        assert torch.equal(torch.cat([p.next_batch()[0] for p in pair]), single.next_batch()[0])
    quad = [TokenLoader(prepared, "train", 16, 1, seed=5, rank=r, world_size=4) for r in range(4)]
    for q in quad:
        q.load_state_dict(pair[0].state_dict())
    for _ in range(3):
        assert torch.equal(torch.cat([q.next_batch()[0] for q in quad]), single.next_batch()[0])


def test_resume_rejects_other_settings(prepared):
    state = TokenLoader(prepared, "train", 16, 4, seed=0).state_dict()
    for loader, key in ((TokenLoader(prepared, "train", 32, 4, seed=0), "seq_len"),
                        (TokenLoader(prepared, "train", 16, 4, seed=1), "seed"),
                        (TokenLoader(prepared, "val", 16, 4, seed=0), "split")):
        with pytest.raises(ScalevecError, match=key):
            loader.load_state_dict(state)


def test_validation_batches_repeat_after_reset(prepared):
    loader = TokenLoader(prepared, "val", 16, 3, seed=0)
    first = [loader.next_batch()[0] for _ in range(4)]
    loader.reset()
    assert all(torch.equal(a, loader.next_batch()[0]) for a in first)
    fresh = TokenLoader(prepared, "val", 16, 3, seed=0)
    assert all(torch.equal(a, fresh.next_batch()[0]) for a in first)


def test_split_too_short_for_one_sequence_is_an_error(prepared):
    too_long = prepared.manifest["val"]["num_tokens"]
    with pytest.raises(ScalevecError, match="val split"):
        TokenLoader(prepared, "val", too_long, 1, seed=0)


# --- other sources --------------------------------------------------------------------------------


def test_stdlib_default_preparation(tmp_path):
    """The one run of the real default: the running Python's standard library, vocab 4096."""
    data = prepare_data(DataConfig(cache_dir=str(tmp_path)))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = {p.read_bytes().decode("utf-8", errors="replace") for p in stdlib.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.parts)}
    val = split_texts(data, "val")
    assert data.vocab_size == 4096 and data.manifest["train"]["dtype"] == "uint16"
    assert val and set(val) <= texts
    assert data.manifest["train"]["num_documents"] + len(val) > 0.9 * len(texts)
    inputs, targets, _ = TokenLoader(data, "train", 128, 2, seed=0).next_batch()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_python_env_is_the_stdlib_then_the_installed_packages():
    """The files a walk of each folder finds (hidden folders, caches and the stdlib's own
    site-packages left out), the standard library first; keys name the folder they came from."""
    paths = sysconfig.get_paths()

    def found(root: Path, skip: set[str]) -> list[str]:
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                      if not skip & set(p.relative_to(root).parts[:-1])
                      and not any(part.startswith(".") for part in p.relative_to(root).parts[:-1]))

    stdlib = found(Path(paths["stdlib"]), {"site-packages", "dist-packages", "__pycache__"})
    packages = found(Path(paths["purelib"]), {"site-packages", "dist-packages", "__pycache__"})
    corpus = open_corpus(DataConfig(source="python_env"))
    keys = corpus.keys()
    assert sorted(keys[:len(stdlib)]) == ["stdlib/" + k for k in stdlib]
    # this venv: one package folder
    assert sorted(keys[len(stdlib):]) == ["purelib/" + k for k in packages]
    assert "purelib/numpy/__init__.py" in keys and "stdlib/json/decoder.py" in keys
    doc = next(d for d in corpus.documents() if d.key == "purelib/numpy/__init__.py")
    assert doc.read() == (Path(paths["purelib"]) / "numpy" / "__init__.py").read_text()


def test_hf_without_datasets_says_how_to_install(tmp_path, monkeypatch):
    hide_package(monkeypatch, "datasets")
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ScalevecError, match="datasets"):
        prepare_data(DataConfig(source="hf", path=str(tmp_path / "rows.jsonl"),
                                cache_dir=str(tmp_path / "c"), vocab_size=VOCAB))


def test_hf_byte_cap_keeps_whole_leading_documents(tmp_path, monkeypatch):
    """As for files: whole documents up to the cap, and at least the first real one however large;
    skipped empty rows do not count as documents. The rows stand in for `datasets`' reader."""
    from scalevec_train.data.corpus import HfCorpus

    rows = [{"text": None}, {"text": "x" * 100}, {"text": "y" * 10}, {"text": "z" * 10}]
    monkeypatch.setattr(HfCorpus, "_load", lambda self: iter(rows))
    corpus = HfCorpus(DataConfig(source="hf", path=str(tmp_path), max_corpus_bytes=50))
    assert [(d.key, d.size, d.read()) for d in corpus.documents()] == [("1", 100, "x" * 100)]
    corpus = HfCorpus(DataConfig(source="hf", path=str(tmp_path), max_corpus_bytes=115))
    assert [(d.key, d.read()) for d in corpus.documents()] == [("1", "x" * 100), ("2", "y" * 10)]

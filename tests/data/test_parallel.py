"""Preparation on every core and on many processes: the same shards, byte for byte, for any number
of encoding workers and of preparing processes (torchrun, a SLURM array), as one process
writes them.

References: each split's token stream is recomputed here document by document with SentencePiece, in
the order of the files; the shard layout from the files' sizes, data.part_bytes
and data.shard_tokens.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from scalevec_train import prepare_data as prepare_cli
from scalevec_train.data import PreparedData, prepare_data
from scalevec_train.data.encode import Batch, encode_batches
from scalevec_train.data.parts import launch_processes
from scalevec_train.data.split import ValSplit
from scalevec_train.infra.errors import ScalevecError
from tests.support.corpora import (
    VOCAB,
    folder_bytes,
    split_texts,
    split_tokens,
    text_cfg,
    write_corpus,
)
from tests.support.launch import torchrun

PART, SHARD = 3000, 800  # a few documents per part, and parts longer than a shard


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root, n_docs=24, seed=1)


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory) -> PreparedData:
    return prepare_data(text_cfg(corpus[0], tmp_path_factory.mktemp("one"), part_bytes=PART,
                                 shard_tokens=SHARD))


def cli_overrides(corpus: Path, cache: Path) -> list[str]:
    return ["data=text_dir", f"data.path={corpus}", f"data.cache_dir={cache}",
            f"model.vocab_size={VOCAB}", "data.val_fraction=0.2", f"data.part_bytes={PART}",
            f"data.shard_tokens={SHARD}", "data.num_workers=1"]


def test_parts_and_shards_follow_the_documents(one_process, corpus):
    root, docs = corpus
    walk_order = sorted(docs, key=lambda rel: (rel.count("/"), rel))
    parts, filled = [[]], 0
    for rel in walk_order:
        if filled >= PART:
            parts.append([])
            filled = 0
        parts[-1].append(rel)
        filled += (root / rel).stat().st_size
    assert len(parts) > 3
    sp, eos = one_process.load_tokenizer(), one_process.eos_id
    val = set(split_texts(one_process, "val"))
    for split in ("train", "val"):
        stream, shard_sizes = [], []
        for part in parts:
            tokens = [t for rel in part if (docs[rel] in val) == (split == "val")
                      for t in sp.encode(docs[rel]) + [eos]]
            stream += tokens
            shard_sizes += [min(SHARD, len(tokens) - start)
                            for start in range(0, len(tokens), SHARD)]
        assert np.array_equal(split_tokens(one_process, split), np.array(stream))
        assert [s["num_tokens"] for s in one_process.manifest[split]["shards"]] == shard_sizes


def test_two_workers_write_the_same_bytes(one_process, corpus, tmp_path):
    two = prepare_data(text_cfg(corpus[0], tmp_path, part_bytes=PART, shard_tokens=SHARD,
                                num_workers=2))
    assert two.root.name == one_process.root.name
    assert folder_bytes(two.root) == folder_bytes(one_process.root)


def test_workers_take_only_a_few_batches_ahead_and_keep_their_order(one_process):
    """Batches of very different sizes finish out of order; results come back in order, and the
    reader is never more than two batches per worker ahead of the writer."""
    texts = ["x = 1\n" * (1 + (i % 5) * 400) for i in range(30)]
    pulled = []

    def batches():
        for i, text in enumerate(texts):
            pulled.append(i)
            yield Batch(i, [str(i)], [text])

    split = ValSplit(0.2, [str(i) for i in range(30)])
    sp, eos = one_process.load_tokenizer(), one_process.eos_id
    for i, encoded in enumerate(encode_batches(batches(), one_process.tokenizer_path, split,
                                               workers=2)):
        assert len(pulled) <= i + 2 * 2
        side = "val" if split.is_val(str(i)) else "train"
        assert encoded.part == i and encoded.documents[side] == 1
        assert encoded.tokens[side].tolist() == sp.encode(texts[i]) + [eos]
    assert len(pulled) == 30


def test_torchrun_processes_prepare_what_one_process_does(one_process, corpus, processes, tmp_path):
    cache = tmp_path / "cache"
    output = processes.run([*torchrun(2), "-m", "scalevec_train.prepare_data",
                            *cli_overrides(corpus[0], cache)],
                           tmp_path)
    # Who encodes which part, and so which rank merges and what each prints, is the scheduler's
    # choice (a rank that starts late may find every part encoded, or the data merged): the outcome
    # is not.
    assert "prepared" in output
    root = cache / one_process.root.name
    assert folder_bytes(root) == folder_bytes(one_process.root)
    # no staging left
    assert sorted(p.name for p in cache.iterdir()) == [".lock", root.name, "tokenizers"]


def test_slurm_array_tasks_in_any_order_prepare_what_one_process_does(one_process, corpus, tmp_path,
                                                                      monkeypatch, capsys):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    root = tmp_path / one_process.root.name
    for task, message in (("2", "process 1 of 2: its parts are written"), ("1", "prepared")):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
        assert prepare_cli.main(cli_overrides(corpus[0], tmp_path)) == 0
        assert message in capsys.readouterr().out
        assert root.is_dir() == (task == "1")
    assert folder_bytes(root) == folder_bytes(one_process.root)


def test_process_environment():
    assert launch_processes({}) == (0, 1, 1)
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                "SLURM_ARRAY_TASK_COUNT": "3"}
    assert launch_processes(torchrun) == (5, 8, 4)
    slurm = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert launch_processes(slurm) == (3, 4, 1)
    with pytest.raises(ScalevecError, match="--array=0-N"):
        launch_processes({**slurm, "SLURM_ARRAY_TASK_ID": "9"})


def test_a_script_that_prepares_at_import_fails_instead_of_hanging(corpus, processes, tmp_path):
    """Workers start by importing the main script again (spawn): preparing there would wait for the
    lock the script holds."""
    script = tmp_path / "unguarded.py"
    cfg = dict(source="text_dir", path=str(corpus[0]), cache_dir=str(tmp_path / "cache"),
               vocab_size=VOCAB, val_fraction=0.2, part_bytes=PART, num_workers=2)
    script.write_text("from scalevec_train.data import DataConfig, prepare_data\n"
                      f"prepare_data(DataConfig(**{cfg!r}))\n")
    started = processes.start([sys.executable, str(script)], tmp_path)
    # a hang fails at launch.TIMEOUT, beyond a slow start on a busy machine
    assert started.wait() != 0
    assert "was called while a worker process imported the main module" in started.output()

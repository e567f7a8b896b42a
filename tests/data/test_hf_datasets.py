"""source=hf with the real `datasets` library: local jsonl, parquet and save_to_disk folders, and
streaming, each end to end through a short training run. `datasets` is a dev dependency, so CI runs
these tests; where it is missing (the GPU host) they skip.

References: the rows written here (every text comes back whole, in one split, missing texts
skipped), and the formats against each other (the same rows are the same token stream, however they
are stored)."""

import json

import numpy as np
import pytest

from scalevec_train.data import DataConfig, prepare_data, tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.train import run
from tests.support.corpora import VOCAB, split_texts, split_tokens, write_corpus
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.presets import TINY_MODEL

datasets = pytest.importorskip("datasets",
                               reason="Hugging Face datasets is not installed (the hf extra)")
pa = pytest.importorskip("pyarrow")  # datasets' own dependency
pq = pytest.importorskip("pyarrow.parquet")

TINY = [*TINY_MODEL, f"model.vocab_size={VOCAB}", *SHORT_RUN, "train.steps=3", "train.log_every=1",
        "logger.progress_bar=false"]


@pytest.fixture(scope="module", autouse=True)
def datasets_cache(tmp_path_factory):
    """datasets converts local files to Arrow in its cache: a temporary one, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"))
        yield


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict:
    """The same rows as jsonl, parquet and a save_to_disk folder, and a tokenizer trained
    on them."""
    root = tmp_path_factory.mktemp("rows")
    texts = list(write_corpus(root / "texts", n_docs=30, seed=2).values())
    table = [{"id": i, "content": t} for i, t in enumerate(texts)] + [{"id": -1, "content": None}]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in table))
    pq.write_table(pa.Table.from_pylist(table), root / "rows.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(table)}).save_to_disk(
        str(root / "saved"))
    tokenizer.train(tokenizer.training_lines(texts, 1 << 20), VOCAB, "bpe",
                    root / "tokenizer.model")
    return {"root": root, "texts": texts}


FORMATS = {"jsonl": ("rows.jsonl", False), "parquet": ("rows.parquet", False),
           "saved": ("saved", False), "streamed": ("rows.jsonl", True)}


@pytest.fixture(scope="module")
def runs(rows, tmp_path_factory) -> dict:
    """A 3-step run on each format; its prepared data."""
    out = {}
    for name, (path, streaming) in FORMATS.items():
        cfg = make_config("data=hf", f"data.path={rows['root'] / path}", "data.text_field=content",
                          f"data.streaming={str(streaming).lower()}", "data.val_fraction=0.3",
                          f"data.tokenizer_path={rows['root'] / 'tokenizer.model'}",
                          f"data.cache_dir={tmp_path_factory.mktemp('cache')}", *TINY,
                          f"run_dir={tmp_path_factory.mktemp('run') / name}")
        run_dir = run(cfg)
        out[name] = (run_dir, prepare_data(cfg.data))
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_trains_on_every_row(runs, rows, name):
    run_dir, data = runs[name]
    assert sorted(split_texts(data, "train") + split_texts(data, "val")) == sorted(rows["texts"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_000003" / "COMPLETE").is_file()


def test_the_formats_give_the_same_tokens(runs):
    _, reference = runs["jsonl"]
    for name in FORMATS:
        _, data = runs[name]
        for split in ("train", "val"):
            assert np.array_equal(split_tokens(data, split),
                                  split_tokens(reference, split)), (name, split)


def test_a_column_that_is_missing_or_not_text_is_named(rows, tmp_path):
    cfg = DataConfig(source="hf", path=str(rows["root"] / "rows.parquet"), vocab_size=VOCAB,
                     tokenizer_path=str(rows["root"] / "tokenizer.model"), cache_dir=str(tmp_path))
    with pytest.raises(ScalevecError, match=r"data.text_field: 'text' is not a column .* \['id', "
                       r"'content'\]"):
        prepare_data(cfg)
    with pytest.raises(ScalevecError,
                       match="data.text_field: column 'id' .* holds int64, not text"):
        prepare_data(DataConfig(**{**cfg.__dict__, "text_field": "id"}))

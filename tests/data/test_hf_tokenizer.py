"""Hugging Face tokenizers (a tokenizer.json) as data.tokenizer_path: preparation, the checks, and a
run that trains, exports and reloads with the same ids. The tokenizer is trained here with the
`tokenizers` library (nothing downloaded); the reference ids are that library's own encoding of
each document."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from scalevec_train.data import DataConfig, prepare_data
from scalevec_train.data.hf_tokenizer import HfTokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.interop.api import load
from scalevec_train.interop.hf_export import export
from scalevec_train.train import run
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.presets import TINY_MODEL

pytest.importorskip("tokenizers", reason="Hugging Face tokenizers is not installed (the hf extra)")
from tokenizers import (  # noqa: E402
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

EOS = "<|endoftext|>"
SAMPLE = ("def f(x):\n\tif x:\n        return x  +  12345  # größer 日本語 🙂\r\n <|endoftext|> "
          "</s> tail  \n")
TINY = [*TINY_MODEL, "model.vocab_size=512", *SHORT_RUN, "train.steps=4", "train.log_every=4"]


def train_tokenizer(texts: list[str], out: Path, special: list[str], vocab: int = 400) -> Path:
    """Byte-level BPE, as GPT-2 and Llama-3 use; its post-processor appends EOS (as GPT-style
    tokenizers may), which scalevec must not apply to a document's tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if EOS in special:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS}", special_tokens=[(EOS, tok.token_to_id(EOS))])
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def reference_ids(path: Path, text: str) -> list[int]:
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True  # special tokens in text are text, as for SentencePiece
    return tok.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def texts(corpus_dir) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(corpus_dir.iterdir())}


@pytest.fixture(scope="module")
def tok_json(texts, tmp_path_factory) -> Path:
    return train_tokenizer(list(texts.values()), tmp_path_factory.mktemp("tok") / "tokenizer.json",
                           [EOS])


def test_preparation_encodes_each_document_like_tokenizers(tok_json, texts, corpus_dir, tmp_path):
    cfg = DataConfig(source="text_dir", path=str(corpus_dir), tokenizer_path=str(tok_json),
                     vocab_size=512, cache_dir=str(tmp_path), num_workers=1, val_fraction=0.2)
    data = prepare_data(cfg)
    eos = Tokenizer.from_file(str(tok_json)).token_to_id(EOS)
    assert (data.vocab_size, data.eos_id) == (400, eos)
    assert data.tokenizer_path == data.root / "tokenizer.json"
    assert data.tokenizer_path.read_bytes() == tok_json.read_bytes()
    docs = {}
    for split in ("train", "val"):
        m = data.manifest[split]
        tokens = np.concatenate([np.fromfile(data.root / split / s["name"], dtype=np.uint16)
                                 for s in m["shards"]])
        assert m["eos_id"] == eos and tokens[-1] == eos
        for doc in np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]:
            docs[split, data.load_tokenizer().decode(doc[:-1].tolist())] = doc[:-1].tolist()
    assert sorted(text for _, text in docs) == sorted(texts.values())
    for (_, text), ids in docs.items():
        assert ids == reference_ids(tok_json, text)
    # the folder holding it names the same tokenizer, so the same prepared data
    assert prepare_data(DataConfig(**{**cfg.__dict__,
                                      "tokenizer_path": str(tok_json.parent)})).root == data.root


def test_special_tokens_in_text_are_text(tok_json):
    tok = HfTokenizer(tok_json)
    ids = tok.encode(SAMPLE)
    assert tok.eos_id() not in ids and ids == reference_ids(tok_json, SAMPLE)
    assert tok.decode(ids) == SAMPLE


def test_tokenizer_without_one_known_end_of_document_token_is_refused(texts, corpus_dir, tmp_path):
    for special, found in (([], "has none of the special tokens .* Fix: add one as a special "
                                "token"),
                           (["</s>", "<eos>"], r"has several special tokens that may end a "
                                               r"document \(\['</s>', '<eos>'\]\). Fix: keep one")):
        path = train_tokenizer(list(texts.values())[:3],
                               tmp_path / f"{len(special)}" / "tokenizer.json", special, 300)
        with pytest.raises(ScalevecError, match=f"{path}: {found}"):
            prepare_data(DataConfig(source="text_dir", path=str(corpus_dir),
                                    tokenizer_path=str(path), vocab_size=512,
                                    cache_dir=str(tmp_path / "cache")))


def test_model_vocab_must_cover_the_tokenizer_json(tok_json, corpus_dir, tmp_path):
    with pytest.raises(ScalevecError, match="model.vocab_size: 399 is smaller than the data's "
                       "vocabulary of 400"):
        prepare_data(DataConfig(source="text_dir", path=str(corpus_dir),
                                tokenizer_path=str(tok_json), vocab_size=399,
                                cache_dir=str(tmp_path)))


def test_run_trains_exports_and_reloads_with_the_same_ids(tok_json, data_overrides, tmp_path):
    transformers = pytest.importorskip("transformers")
    run_dir = run(make_config(*data_overrides, *TINY, f"data.tokenizer_path={tok_json}",
                              f"run_dir={tmp_path / 'run'}"))
    assert (run_dir / "tokenizer.json").read_bytes() == tok_json.read_bytes()
    assert not (run_dir / "tokenizer.model").exists()
    expected = reference_ids(tok_json, SAMPLE)
    model, tok = load(run_dir)
    assert isinstance(tok, HfTokenizer) and tok.encode(SAMPLE) == expected
    out = export(run_dir, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.eos_id()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode(SAMPLE) == expected  # no EOS appended: the post-processor is not exported
    assert hf_tok.eos_token_id == tok.eos_id()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([expected])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), rtol=0, atol=1e-4)

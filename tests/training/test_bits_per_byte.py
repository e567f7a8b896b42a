"""val_bpb: the evaluator's bits per byte against a direct computation (decode the counted targets,
count their UTF-8 bytes, sum the NLL of the model's logits), for a SentencePiece tokenizer and two
tokenizer.json ones (byte-level BPE; Metaspace with byte fallback), and the one axis that tokenizers
of different vocabularies share."""

import json
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scalevec_train.data import tokenizer
from scalevec_train.data.loader import IGNORE, Batch, document_ids
from scalevec_train.model.transformer import Transformer
from scalevec_train.training.callbacks.evaluation import Validation
from tests.support.helpers import make_config
from tests.support.presets import TINY_MODEL

T = 16
# ASCII first (the first token is an input only), then spaces, newlines, multi-byte characters that
# byte fallback spells out, and a tail
TEXT = (("Hello world, this is the text.\n    return größer + 日本語 🙂 ≠ ∑ x\n"
         "\tdef f(x): pass  \n") * 3
        + "the end\n")


def lines() -> list[str]:
    return [line for line in (TEXT * 4 + "plain words and more words for merges\n" * 20).split("\n")
            if line]


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> tokenizer.Tokenizer:
    out = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    tokenizer.train(lines(), 300, "bpe", out)
    return tokenizer.load(out)


def hf_tokenizer(tmp_path: Path, kind: str, vocab: int) -> tokenizer.Tokenizer:
    """A BPE tokenizer.json trained on lines(): byte-level (GPT-2), or Llama-2 style ("▁" for
    spaces, characters outside the vocabulary as <0xNN> byte pieces of the model's vocabulary)."""
    tokenizers = pytest.importorskip("tokenizers",
                                     reason="Hugging Face tokenizers is not installed")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    byte_level = kind == "byte_level"
    tok = tokenizers.Tokenizer(models.BPE())
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="never"),
                                         decoders.ByteFallback(), decoders.Fuse()])
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    tok.train_from_iterator([line for line in lines() if not any(ord(c) > 127 for c in line)]
                            if not byte_level else lines(),
                            trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"],
                                                initial_alphabet=alphabet, show_progress=False))
    spec = json.loads(tok.to_str())
    if not byte_level:  # the non-ASCII characters of TEXT are left to byte fallback
        pieces = spec["model"]["vocab"]
        for b in range(256):
            pieces[f"<0x{b:02X}>"] = len(pieces)
        spec["model"]["byte_fallback"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return tokenizer.load(tmp_path / "tokenizer.json")


def windows(tok: tokenizer.Tokenizer, documents: bool,
            skip: int = 3) -> tuple[list[Batch], list[int]]:
    """Two batches of rows of T cut from one stream, EOS + TEXT + EOS padding (EOS stands for no
    bytes), so that the counted targets, in order, are one stretch of the stream; the first row's
    first `skip` targets are not counted. Returns the batches and the counted targets."""
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    rows = 2 * math.ceil(len(ids) / (2 * T))
    stream = torch.tensor([tok.eos_id(), *ids, *[tok.eos_id()] * (rows * T - len(ids))])
    inputs = stream[:-1].view(rows, T)
    targets = stream[1:].view(rows, T).clone()
    targets[0, :skip] = IGNORE
    doc_ids = document_ids(inputs, tok.eos_id()) if documents else None
    half = rows // 2
    batches = [Batch(inputs[i:i + half], targets[i:i + half],
                     None if doc_ids is None else doc_ids[i:i + half])
               for i in (0, half)]
    return batches, stream[1 + skip:].tolist()


def text_bytes(tok: tokenizer.Tokenizer, ids: list[int]) -> int:
    return len(tok.decode([i for i in ids if i != tok.eos_id()]).encode())


def evaluate(model: torch.nn.Module, batches: list[Batch],
             tok: tokenizer.Tokenizer) -> tuple[float, float, int]:
    validation = Validation(batches, token_bytes=tokenizer.token_bytes(tok))
    val_loss, val_bpb = validation.evaluate(model, torch.device("cpu"), nullcontext)[""]
    return val_loss.item(), val_bpb.item(), validation.bytes[""]


def check_against_direct(tok: tokenizer.Tokenizer, documents: bool) -> None:
    batches, counted = windows(tok, documents)
    cfg = make_config(*TINY_MODEL, f"model.vocab_size={tok.get_piece_size()}")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed=3)
    _, val_bpb, n_bytes = evaluate(model, batches, tok)
    assert (n_bytes == text_bytes(tok, counted)
            == len(TEXT.encode()) - len(tok.decode(tok.encode(TEXT)[:3]).encode()))
    with torch.no_grad():
        nll = sum(F.cross_entropy(model(b.inputs, **({"doc_ids": b.doc_ids} if documents
                                                     else {})).flatten(0, 1),
                                  b.targets.flatten(), ignore_index=IGNORE, reduction="sum")
                  for b in batches)
    assert val_bpb == pytest.approx(nll.item() / math.log(2) / n_bytes, rel=1e-5)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_sentencepiece_bpb_matches_a_direct_computation(sentencepiece, documents):
    check_against_direct(sentencepiece, documents)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace_byte_fallback"])
def test_tokenizer_json_bpb_matches_a_direct_computation(tmp_path, kind):
    check_against_direct(hf_tokenizer(tmp_path, kind, 400), documents=False)


class Uniform(torch.nn.Module):
    """Equal logits for every id: NLL ln(vocab) per target."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, inputs: torch.Tensor, doc_ids=None) -> torch.Tensor:
        return torch.zeros(*inputs.shape, self.vocab)


def test_tokenizers_of_different_vocabularies_share_one_axis(sentencepiece, tmp_path):
    """The same text under two tokenizers of different vocabularies: both count the text's bytes, so
    a uniform model's val_bpb is log2(vocab) * tokens / bytes, while its val_loss is ln(vocab) per
    token."""
    vocabularies = []
    for tok in (sentencepiece, hf_tokenizer(tmp_path, "byte_level", 700)):
        batches, counted = windows(tok, documents=False, skip=0)
        val_loss, val_bpb, n_bytes = evaluate(Uniform(tok.get_piece_size()), batches, tok)
        assert n_bytes == len(TEXT.encode())
        tokens = len(tok.encode(TEXT))  # the EOS padding counts as tokens of no bytes: add it
        tokens += sum(1 for i in counted if i == tok.eos_id())
        assert val_loss == pytest.approx(math.log(tok.get_piece_size()), rel=1e-6)
        assert val_bpb == pytest.approx(math.log2(tok.get_piece_size()) * tokens / n_bytes,
                                        rel=1e-6)
        vocabularies.append(tok.get_piece_size())
    assert vocabularies[0] != vocabularies[1]

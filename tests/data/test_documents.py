"""The loader's document boundaries (model.attention_mask=document): document ids and uncounted
targets read from the EOS tokens of the stream, against a walk over the stream; the attended keys
that the FLOPs accounting uses, against the block-causal mask counted out."""

import numpy as np
import torch

from scalevec_train.data import TokenLoader
from scalevec_train.data.loader import IGNORE
from scalevec_train.data.permutation import permute
from scalevec_train.model.masking import dense_mask
from tests.support.corpora import split_tokens


def test_document_ids_and_uncounted_targets_follow_the_eos_tokens(prepared):  # noqa: F811
    tokens, eos = split_tokens(prepared, "train"), prepared.eos_id
    seq_len, batch = 64, 4
    loader = TokenLoader(prepared, "train", seq_len, batch, seed=5, documents=True)
    plain = TokenLoader(prepared, "train", seq_len, batch, seed=5)
    n, boundaries = loader.num_windows, 0
    for step in range(n // batch):
        inputs, targets, doc_ids = loader.next_batch()
        plain_inputs, plain_targets, plain_ids = plain.next_batch()
        assert plain_ids is None and torch.equal(inputs, plain_inputs)
        for row in range(batch):
            window = int(permute(np.array([step * batch + row]), n, 5, 0)[0])
            stream = tokens[window * seq_len: window * seq_len + seq_len + 1]
            doc, want_ids, want_targets = 0, [], []
            for t in range(seq_len):
                want_ids.append(doc)
                want_targets.append(IGNORE if stream[t] == eos else stream[t + 1])
                doc += int(stream[t] == eos)
            boundaries += doc
            assert doc_ids[row].tolist() == want_ids
            assert targets[row].tolist() == want_targets
            assert torch.equal(targets[row] != IGNORE, plain_targets[row] == targets[row])
    assert boundaries > 10  # the windows do cross documents


def test_attended_keys_counts_the_block_causal_mask(prepared):  # noqa: F811
    loader = TokenLoader(prepared, "train", 64, 4, seed=0, documents=True)
    windows = min(1024, loader.num_windows)
    doc_ids = loader.read(np.arange(windows)).doc_ids
    want = dense_mask(doc_ids).sum().item() / doc_ids.numel()
    assert loader.attended_keys() == want
    assert want < (64 + 1) / 2  # fewer than causal attention over the whole window
    assert loader.position == 0  # measuring draws no samples

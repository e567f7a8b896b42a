"""Attention within documents (model.attention_mask=document): a document's logits do not depend on
the documents before it in the window, the block-causal mask and positions against written-out
references, FlexAttention against the dense-mask SDPA reference, compile and
activation checkpointing."""

import pytest
import torch
import torch.nn.functional as F

from scalevec_train.model import Transformer
from scalevec_train.model.masking import block_mask, dense_mask, flex_attention, positions
from scalevec_train.parallel.wrap import wrap_block
from tests.support.helpers import make_config_shared
from tests.support.launch import compile_backend

# three documents in a row of 24 tokens (lengths 7, 9, 8), and a second row of two (12, 12)
DOC_IDS = torch.tensor([[0] * 7 + [1] * 9 + [2] * 8, [0] * 12 + [1] * 12])
# per-head norms behind q, k (and v under unified)
HEAD_NORMS = ["scale=unified", "model.qk_norm=true"]


def model_for(*overrides: str, seed: int = 0) -> Transformer:
    cfg = make_config_shared("model.n_layers=2", "model.n_kv_heads=2",
                             "model.attention_mask=document", *overrides)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed)
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 4096, DOC_IDS.shape, generator=torch.Generator().manual_seed(seed))


def test_positions_and_mask_match_written_out_references():
    want_pos = torch.tensor([list(range(7)) + list(range(9)) + list(range(8)), list(range(12)) * 2])
    assert torch.equal(positions(DOC_IDS), want_pos)
    mask = dense_mask(DOC_IDS)
    for b in range(2):
        for q in range(24):
            for k in range(24):
                assert mask[b, 0, q, k] == (k <= q and DOC_IDS[b, q] == DOC_IDS[b, k])


@pytest.mark.parametrize("rope_reset", [False, True])
@pytest.mark.parametrize("extra", [[], HEAD_NORMS])
def test_changing_one_document_leaves_the_next_ones_logits_unchanged(rope_reset, extra):
    """fp32, exactly: the masked scores are -inf before the softmax, so the earlier document's
    values reach no later query."""
    model = model_for(f"model.rope_reset={str(rope_reset).lower()}", *extra)
    x = tokens()
    y = x.clone()
    y[0, :7] = tokens(seed=2)[0, :7]  # row 0: another first document
    y[1, :12] = tokens(seed=3)[1, :12]
    a, b = model(x, doc_ids=DOC_IDS), model(y, doc_ids=DOC_IDS)
    assert torch.equal(a[0, 7:], b[0, 7:]) and torch.equal(a[1, 12:], b[1, 12:])
    assert (a[0, :7] - b[0, :7]).abs().max() > 1e-3
    causal = model_for("model.attention_mask=causal", *extra)
    assert (causal(x)[0, 7:] - causal(y)[0, 7:]).abs().max() > 1e-3  # the test can fail


def test_with_rope_reset_a_document_reads_as_if_it_began_the_row():
    """Its logits in the window equal those of the document alone (positions from 0)."""
    model = model_for("model.rope_reset=true", *HEAD_NORMS)
    x = tokens()
    together = model(x, doc_ids=DOC_IDS)
    alone = model(x[:1, 7:16])  # the second document of row 0, no ids: causal over one document
    torch.testing.assert_close(together[:1, 7:16], alone, rtol=1e-5, atol=1e-5)


def test_without_ids_or_with_one_document_it_is_causal():
    model = model_for(*HEAD_NORMS)
    causal = model_for("model.attention_mask=causal", *HEAD_NORMS)
    x = tokens()
    assert torch.equal(model(x), causal(x))
    torch.testing.assert_close(model(x, doc_ids=torch.zeros_like(DOC_IDS)), causal(x), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(causal(x, doc_ids=DOC_IDS), causal(x))  # a causal model ignores the ids


@pytest.mark.skipif(flex_attention is None, reason="torch without FlexAttention")
def test_flex_attention_equals_the_dense_reference_forward():
    """On CPU, eager and forward only (torch has no FlexAttention backward on CPU); the backward and
    the compiled kernel: tests/gpu/test_training_gpu.py."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 16, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(DOC_IDS))
    got = flex_attention(q, k, v, block_mask=block_mask(DOC_IDS))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        flex, dense = (model_for("model.attention_backend=flex"),
                       model_for("model.attention_backend=sdpa"))
        torch.testing.assert_close(flex(tokens(), doc_ids=DOC_IDS),
                                   dense(tokens(), doc_ids=DOC_IDS), rtol=1e-5, atol=1e-5)


def loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = tokens()
    loss = F.cross_entropy(model(x[:, :-1], doc_ids=DOC_IDS[:, :-1]).flatten(0, 1),
                           x[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("ac,compiled", [("selective", False), ("full", False), ("none", True)])
def test_checkpointing_and_compile_keep_document_masking(ac, compiled):
    # One block: each block is wrapped (and compiled) on its own with the same mask and positions,
    # and a second one only repeated the work (dynamo traces every compiled block again)
    overrides = [*HEAD_NORMS, "model.rope_reset=true", "model.n_layers=1"]
    want_loss, want = loss_and_grads(model_for(*overrides))
    model = model_for(*overrides)
    # aot_eager: the masks and positions as dynamo and AOT autograd capture them, without inductor's
    # code generation (minutes of C++ on a fresh machine; test_compile.py compares
    # inductor's numbers)
    with compile_backend("aot_eager"):
        for block in model.layers:
            wrap_block(block, ac, compile_block=compiled)
    loss, grads = loss_and_grads(model)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_flex_training_on_cpu_is_refused_before_any_work(tmp_path):
    from scalevec_train.infra.errors import ScalevecError
    from scalevec_train.run.build import build

    cfg = make_config_shared("model.attention_mask=document", "model.attention_backend=flex",
                             "device=cpu", f"run_dir={tmp_path / 'run'}")
    with pytest.raises(ScalevecError, match="model.attention_backend: flex trains on CUDA only"):
        build(cfg)
    assert not (tmp_path / "run").exists()


def test_describe_and_flops_count_the_attention_the_mask_leaves():
    """Attention FLOPs per token: 12 * layers * width * 2 * (mean keys a query attends) under
    document masking, in place of 12 * layers * width * seq_len; the rest unchanged."""
    from scalevec_train.costs.accounting import matmul_params_per_token, train_flops_per_token
    from scalevec_train.costs.tables import describe

    causal = make_config_shared("train.seq_len=128")
    document = make_config_shared("train.seq_len=128", "model.attention_mask=document")
    model = Transformer(causal.model, causal.scale)
    width = causal.model.n_heads * causal.model.head_dim
    matmuls = 6 * matmul_params_per_token(model)
    assert train_flops_per_token(model, 128) == matmuls + 12 * causal.model.n_layers * width * 128
    assert (train_flops_per_token(model, 128, 20.0)
            == matmuls + 12 * causal.model.n_layers * width * 40)
    assert (describe(document, 20.0)["train_flops_per_token"]
            == train_flops_per_token(model, 128, 20.0))
    assert describe(document, 20.0)["attended_keys"] == 20.0
    assert describe(causal, 20.0)["train_flops_per_token"] == train_flops_per_token(model, 128)
    assert "attention_mask" not in describe(causal)

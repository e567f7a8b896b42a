"""The loss under document masking: targets after an EOS are not counted, so micro-batches and ranks
count different numbers of targets; the step's loss and gradients must still be the mean over every
counted target of the global batch (against autograd of that mean over the whole batch at once), for
1 and 4 micro-batches and for 2 ranks of 2; and the z-loss against its closed form and autograd, and
added to the causal loss and logged apart."""

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from scalevec_train.data.loader import IGNORE, Batch, document_ids
from scalevec_train.model import Transformer
from scalevec_train.parallel.data_parallel import parallelize
from scalevec_train.parallel.process_group import full_value
from scalevec_train.training.trainer import Callback, Compute, Schedule, StepRecipe, Trainer, z_loss
from tests.support.helpers import ListLoader, make_config
from tests.support.launch import gloo_group, spawn
from tests.support.presets import SMALL_MODEL

EOS, SEQ = 1, 16
# EOS positions per row: 3, 0, 1 and 2 documents end in the rows, so they count 13, 16, 15, 14
# targets
EOS_AT = [[2, 6, 11], [], [8], [4, 5]]
MODEL = [*SMALL_MODEL, "model.ffn_dim=64", "model.vocab_size=64", "model.attention_mask=document",
         "model.rope_reset=true", "scale=unified"]


def rows() -> Batch:
    """The global batch of 4 rows as the loader makes it (document ids, IGNORE after each EOS)."""
    tokens = torch.randint(2, 64, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for row, positions in enumerate(EOS_AT):
        tokens[row, positions] = EOS
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    return Batch(inputs, targets.masked_fill(inputs == EOS, IGNORE), document_ids(inputs, EOS))


ONE_STEP, CPU = (Schedule(steps=1, lr_at=lambda step: 1.0, log_every=1),
                 Compute(torch.device("cpu"), nullcontext))


class Capture(Callback):
    def on_backward_end(self, trainer: Trainer) -> None:
        self.grads = {n: full_value(p.grad).clone() for n, p in trainer.model.named_parameters()}


def model() -> Transformer:
    cfg = make_config(*MODEL)
    m = Transformer(cfg.model, cfg.scale)
    m.init_weights(0)
    return m


def reference(coef: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(CE, z-loss term, gradients) of the mean over all counted targets of the batch in one
    forward."""
    m, batch = model(), rows()
    logits = m(batch.inputs, doc_ids=batch.doc_ids).flatten(0, 1)
    targets = batch.targets.flatten()
    counted = targets != IGNORE
    ce = F.cross_entropy(logits[counted], targets[counted])
    z = coef * logits[counted].logsumexp(-1).square().mean()
    (ce + z).backward()
    return ce.detach(), z.detach(), {n: p.grad for n, p in m.named_parameters()}


def train_step(m, batches: list[Batch], coef: float):
    optimizer = torch.optim.SGD(m.parameters(), lr=0.0)
    optimizer.param_groups[0]["base_lr"] = 0.0
    capture = Capture()
    trainer = Trainer(m, optimizer, ListLoader(batches), ONE_STEP,
                      StepRecipe(accum=len(batches), tokens_per_step=4 * SEQ, grad_clip=0.0,
                                 z_loss_coef=coef, documents=True), CPU, [capture])
    result = trainer.train_step()
    return result, capture.grads


def split(batch: Batch, parts: int) -> list[Batch]:
    inputs, targets = batch.inputs.chunk(parts), batch.targets.chunk(parts)
    doc_ids = [None] * parts if batch.doc_ids is None else batch.doc_ids.chunk(parts)
    return [Batch(*fields) for fields in zip(inputs, targets, doc_ids, strict=True)]


@pytest.mark.parametrize("coef", [0.0, 1e-2])
@pytest.mark.parametrize("accum", [1, 4])
def test_accumulation_gives_the_global_mean_when_counts_differ(accum, coef):
    counts = [(b.targets != IGNORE).sum().item() for b in split(rows(), 4)]
    assert counts == [13, 16, 15, 14]
    want_ce, want_z, want = reference(coef)
    result, grads = train_step(model(), split(rows(), accum), coef)
    torch.testing.assert_close(result.loss, want_ce, rtol=1e-6, atol=1e-6)
    if coef:
        torch.testing.assert_close(result.z_loss, want_z, rtol=1e-5, atol=1e-8)
    else:
        assert result.z_loss is None
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_the_plain_mean_of_micro_batch_means_would_differ():
    """The weighting matters here: the mean of the four rows' means is another loss."""
    want_ce, _, _ = reference(0.0)
    m = model()
    means = [F.cross_entropy(m(b.inputs, doc_ids=b.doc_ids).flatten(0, 1), b.targets.flatten(),
                             ignore_index=IGNORE)
             for b in split(rows(), 4)]
    assert abs(torch.stack(means).mean().item() - want_ce.item()) > 1e-4


def _rank(rank: int, world: int, store: str, out: str) -> None:
    with gloo_group(store, rank, world):
        cfg = make_config(*MODEL, world_size=world)
        with torch.device("meta"):
            m = Transformer(cfg.model, cfg.scale)
        m = parallelize(m, cfg.distributed, torch.device("cpu"), seed=0, dtype="fp32")
        parts = split(rows(), 4)
        mine = [parts[rank], parts[rank + 2]]  # rank 0 counts 13 + 15 targets, rank 1 16 + 14
        result, grads = train_step(m, mine, 1e-2)
        torch.save({"loss": result.loss, "z": result.z_loss, "grads": grads},
                   f"{out}/rank{rank}.pt")


def test_two_ranks_of_two_micro_batches_give_the_global_mean(tmp_path):
    spawn(_rank, (2, str(tmp_path / "store"), str(tmp_path)))
    want_ce, want_z, want = reference(1e-2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], want_ce, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["z"], want_z, rtol=1e-5, atol=1e-8)
        for name, g in want.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_z_loss_against_its_closed_form_and_autograd():
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    targets[0, 1] = targets[1, 4] = IGNORE
    counted = (targets != IGNORE).double()
    # log of the partition function, written out
    log_z = torch.log(torch.exp(logits.detach()).sum(-1))
    want = (log_z ** 2 * counted).sum() / counted.sum()
    got = z_loss(logits, targets)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    got.backward()
    # d/dlogits mean(log Z^2) = 2 log Z softmax(logits) / count, zero where not counted
    closed = (2 * log_z[..., None] * torch.softmax(logits.detach(), -1) * counted[..., None]
              / counted.sum())
    torch.testing.assert_close(logits.grad, closed, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("accum", [1, 4])
def test_z_loss_under_causal_attention_is_added_and_logged_apart(accum):
    """Every target counts: the step's loss stays the cross-entropy, z_loss is coef * mean(log Z^2),
    and the gradient is that of their sum."""
    cfg = make_config(*MODEL, "model.attention_mask=causal", "model.rope_reset=false")
    m = Transformer(cfg.model, cfg.scale)
    m.init_weights(0)
    batch = rows()
    batch = Batch(batch.inputs, torch.cat([batch.inputs[:, 1:], batch.inputs[:, :1]], 1), None)
    logits = m(batch.inputs).flatten(0, 1)
    ce = F.cross_entropy(logits, batch.targets.flatten())
    z = 1e-2 * logits.logsumexp(-1).square().mean()
    (ce + z).backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    optimizer = torch.optim.SGD(m.parameters(), lr=0.0)
    optimizer.param_groups[0]["base_lr"] = 0.0
    capture = Capture()
    trainer = Trainer(m, optimizer, ListLoader(split(batch, accum)), ONE_STEP,
                      StepRecipe(accum=accum, tokens_per_step=4 * SEQ, grad_clip=0.0,
                                 z_loss_coef=1e-2), CPU, [capture])
    result = trainer.train_step()
    torch.testing.assert_close(result.loss, ce.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(result.z_loss, z.detach(), rtol=1e-5, atol=1e-8)
    for name, g in want.items():
        torch.testing.assert_close(capture.grads[name], g, rtol=1e-4, atol=1e-7, msg=name)

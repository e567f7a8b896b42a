"""What a model costs: parameters (total and active per token), FLOPs per token, and MFU.

Training FLOPs per token = 6 * (parameters in matrix multiplies that a token passes through) +
12 * n_layers * seq_len * attention width: the forward pass does 2 FLOPs per weight per token
(multiply and add) and the backward pass twice that; causal attention's QK^T and AV products cost
2 * 2 * seq * width per token forward, halved by the causal mask in real kernels but counted whole,
as PaLM and Megatron do, so MFU figures compare with theirs. Under document masking a query attends
only to its document's earlier tokens: attention counts 2 * (the mean keys a query attends, measured
on the data: TokenLoader.attended_keys) in place of seq_len, the same convention, and what the
block-sparse kernel (FlexAttention) spends up to its block granularity. Embedding lookups are free;
the output head counts. MoE layers count only the experts a token is routed to.

Normalizations and scale sites are counted apart (norm_flops_per_token), from the rows of the scale
plan: per element and token, forward, a normalization N costs 3 FLOPs (square-accumulate, scale by
the inverse RMS, and the RMS itself amortized) and a scale site 1 multiply (NORM_FLOPS, SITE_FLOPS);
training costs 3x forward.
"""

import torch
from torch import nn

from scalevec_train.model.moe import MoEFeedForward
from scalevec_train.model.plan import ScalePlan
from scalevec_train.model.transformer import Transformer

NORM_FLOPS, SITE_FLOPS = 3, 1

# Dense bf16 peak FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "4090": 165e12,
}


def total_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def active_params(model: nn.Module) -> int:
    """Parameters a token uses: all of them minus, per MoE layer, the routed experts it skips
    (their per-expert parameters times 1 - top_k / num_experts)."""
    skipped = 0
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            skipped += (m.experts.per_expert_numel() * (m.cfg.num_experts - m.cfg.top_k)
                        // m.cfg.num_experts)
    return total_params(model) - skipped


def matmul_params_per_token(model: Transformer) -> int:
    """Weights a token multiplies with: everything but the embedding table (unless tied: then it is
    the head) and scale sites, with routed experts counted top_k / num_experts."""
    cfg = model.cfg
    site_params = model.plan.site_parameters()
    total = 0
    for name, p in model.named_parameters():
        if name in site_params or name == "tok_emb.weight":
            continue
        if ".experts." in name:
            total += p.numel() * cfg.moe.top_k // cfg.moe.num_experts
        else:
            total += p.numel()
    if cfg.tie_embeddings:
        total += cfg.vocab_size * cfg.dim
    return total


def non_embedding_params(model: nn.Module) -> int:
    """N of `train.tokens_per_param` and of the ladder's size rule: the weights a token multiplies
    with (MoE: the active ones) minus the embedding and the output head. Without embeddings because
    at the ladder's small sizes the vocabulary table is a large, size-irregular share (Kaplan et al.
    2020 fit cleaner laws without it); active because 6 N D is then the training compute; without
    scale sites so that every strategy of a model gets the same token budget."""
    return matmul_params_per_token(model) - model.cfg.vocab_size * model.cfg.dim


def train_flops_per_token(model: nn.Module, seq_len: int, attended: float | None = None) -> float:
    """attended: the mean keys a query attends under document masking (None: causal)."""
    cfg = model.cfg
    context = seq_len if attended is None else 2 * attended
    attention = 12 * cfg.n_layers * context * cfg.n_heads * cfg.head_dim
    return 6 * matmul_params_per_token(model) + attention


def norm_flops_per_token(plan: ScalePlan) -> int:
    """Forward FLOPs per token spent in normalizations and scale sites: every normalization a site
    multiplies (each counted once, however many sites it feeds) and every site that is not fixed,
    over the features they act on, as often as a token passes them (top_k times inside routed
    experts)."""
    norms = {row.norm for row in plan.rows if row.norm is not None}
    return (sum(NORM_FLOPS * n.width * n.passes for n in norms)
            + sum(SITE_FLOPS * row.width * row.passes for row in plan.rows if row.param != "fixed"))


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None when unknown (then MFU is not logged). MFU is against
    it under model.fp8 too, so that runs in bf16 and in FP8 compare on one scale."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    return None

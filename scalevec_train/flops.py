"""FLOPs per token and device peaks, for throughput accounting (MFU).

Training FLOPs per token = 6 * (parameters in matrix multiplies that a token passes through) +
12 * n_layers * seq_len * attention width: the forward pass does 2 FLOPs per weight per token
(multiply and add) and the backward pass twice that; causal attention's QK^T and AV products cost
2 * 2 * seq * width per token forward, halved by the causal mask in real kernels but counted whole,
as PaLM and Megatron do, so MFU figures compare with theirs. Embedding lookups are free; the output
head counts. MoE layers count only the experts a token is routed to.
"""

import torch
from torch import nn

from scalevec_train.strategies import scale_sites

# Per element and token, forward: a normalization N costs 3 FLOPs (square-accumulate, scale by the
# inverse RMS, and the RMS itself amortized), a scale site 1 multiply. Training costs 3x forward.
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


def matmul_params_per_token(model: nn.Module) -> int:
    """Weights a token multiplies with: everything but the embedding table (unless tied: then it is
    the head) and scale sites, with routed experts counted top_k / num_experts."""
    cfg = model.cfg
    site_params = {id(p) for _, site in scale_sites(model) for p in site.parameters()}
    total = 0
    for name, p in model.named_parameters():
        if id(p) in site_params or name == "tok_emb.weight":
            continue
        if ".experts." in name:
            total += p.numel() * cfg.moe.top_k // cfg.moe.num_experts
        else:
            total += p.numel()
    if cfg.tie_embeddings:
        total += cfg.vocab_size * cfg.dim
    return total


def train_flops_per_token(model: nn.Module, seq_len: int) -> float:
    cfg = model.cfg
    attention = 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6 * matmul_params_per_token(model) + attention


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None when unknown (then MFU is not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    return None

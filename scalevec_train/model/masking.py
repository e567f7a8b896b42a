"""Attention within documents (model.attention_mask=document): the masks and RoPE positions that
follow from the document ids the loader gives with each window.

doc_ids [batch, seq] numbers the documents of a row in order (the loader's rule,
docs/guides/data.md: an EOS belongs to the document it ends). Query i attends key j when j <= i and
doc_ids[i] == doc_ids[j]: block-causal. Two kernels compute it:
  flex  FlexAttention with a BlockMask: blocks that the mask empties are skipped, so the cost
        follows the documents' lengths. Compiled (eager FlexAttention materializes the scores);
        torch has no FlexAttention backward on CPU, so it trains on CUDA only.
  sdpa  SDPA with a dense boolean mask [batch, 1, seq, seq]: the reference, and the fallback. It
        costs a full seq x seq product (no causal skip) and the mask's memory.
"""

import functools

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch without FlexAttention: the sdpa kernel only
    BlockMask = create_block_mask = flex_attention = None


def backend_for(choice: str, device: torch.device) -> str:
    """model.attention_backend resolved for `device`: auto is flex on CUDA (where torch has it),
    sdpa elsewhere."""
    if choice == "auto":
        return "flex" if device.type == "cuda" and flex_attention is not None else "sdpa"
    return choice


def positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (0 at each document start, and at the window's)."""
    seq = doc_ids.shape[-1]
    index = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def dense_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] bool, True where query (row) may attend key (column)."""
    seq = doc_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal).unsqueeze(1)


def block_mask(doc_ids: torch.Tensor) -> "BlockMask":
    """The same mask as dense_mask, as FlexAttention's block-sparse BlockMask."""
    batch, seq = doc_ids.shape

    def same_document(b, h, q, kv):
        return (doc_ids[b, q] == doc_ids[b, kv]) & (kv <= q)

    return create_block_mask(same_document, batch, None, seq, seq, device=doc_ids.device)


def document_mask(doc_ids: torch.Tensor, backend: str) -> "torch.Tensor | BlockMask":
    """The mask the attention of every layer uses, built once per forward."""
    return block_mask(doc_ids) if backend == "flex" else dense_mask(doc_ids)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: "torch.Tensor | BlockMask | None", gqa: bool,
           scale: float | None = None) -> torch.Tensor:
    """Attention of q [batch, heads, seq, head_dim] over k, v: causal without a mask, else `mask`'s;
    `scale` multiplies the logits (None: 1 / sqrt(head_dim))."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    # eager FlexAttention (CPU inference) is unfused but exact; compiled is the kernel
    flex = _compiled_flex() if q.is_cuda else flex_attention
    return flex(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale)

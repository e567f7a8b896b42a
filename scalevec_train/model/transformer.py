"""The decoder: Llama-style pre-norm blocks (RMSNorm, RoPE, grouped-query attention, SwiGLU or MoE),
with scale sites placed by the strategy (strategies.py). A plain nn.Module: parallelism, precision and
compilation are applied from outside; the normalization kernels (model.kernels) are chosen when the
layers are built.

    a = N(x) scaled per branch             (attn_norm: one site, or q/k/v sites under HG)
    q, k, v = Wq a_q, Wk a_k, Wv a_v       (each map may have an output norm and site: QK-norm, DNP)
    h = x + Wo SDPA(rope(q), rope(k), v)   (Wo may have input/output sites and a post-norm; causal, or
                                            within documents: masking.py)
    b = N(h) scaled per branch             (ffn_norm)
    y = h + Wdown (silu(Wgate b_g) * Wup b_u)
    logits = Whead (s_final * N(x_L))

Initialization (documented in configs/model/*.yaml): embeddings and every matrix ~ N(0, init_std),
the maps that write into the residual stream (o, down) ~ N(0, init_std / sqrt(2 * n_layers)); every
scale site starts at s = 1. Values depend only on (seed, parameter name), never on sharding.
"""

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_train.model.config import ModelConfig, ScaleConfig
from scalevec_train.model.layers import Linear, PreNorm, Rotary
from scalevec_train.model.masking import attend, backend_for, document_mask, positions
from scalevec_train.model.moe import MoEFeedForward
from scalevec_train.model.strategies import ScaledMap, ScaleSite, SiteMaps, input_branches
from scalevec_train.model.swiglu import swiglu


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, scale: ScaleConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wq = Linear("q", cfg.dim, q_width, scale, cfg)
        self.wk = Linear("k", cfg.dim, kv_width, scale, cfg)
        self.wv = Linear("v", cfg.dim, kv_width, scale, cfg)
        self.wo = Linear("o", q_width, cfg.dim, scale, cfg)

    def input_maps(self, branch: str) -> list[ScaledMap]:
        """The maps that read pre-norm branch `branch`."""
        maps = {"q": [self.wq], "k": [self.wk], "v": [self.wv]}.get(branch, [self.wq, self.wk, self.wv])
        return [m.as_input() for m in maps]

    def site_maps(self) -> list[SiteMaps]:
        return [entry for m in (self.wq, self.wk, self.wv, self.wo) for entry in m.site_maps()]

    def forward(self, a: dict[str, torch.Tensor], rope: Rotary, mask=None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """mask: None (causal) or document_mask's; positions: RoPE positions (None: 0..seq-1)."""
        shared = a.get("attn")
        q = self.wq(a.get("q", shared))
        k = self.wk(a.get("k", shared))
        v = self.wv(a.get("v", shared))
        batch, seq, _ = q.shape
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = attend(rope(q, positions), rope(k, positions), v, mask, self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU (swiglu.py), its sites held by its three maps."""

    def __init__(self, cfg: ModelConfig, scale: ScaleConfig, hidden: int):
        super().__init__()
        self.w_gate = Linear("gate", cfg.dim, hidden, scale, cfg)
        self.w_up = Linear("up", cfg.dim, hidden, scale, cfg)
        self.w_down = Linear("down", hidden, cfg.dim, scale, cfg)

    def input_maps(self, branch: str) -> list[ScaledMap]:
        maps = {"gate": [self.w_gate], "up": [self.w_up]}.get(branch, [self.w_gate, self.w_up])
        return [m.as_input() for m in maps]

    def site_maps(self) -> list[SiteMaps]:
        return [entry for m in (self.w_gate, self.w_up, self.w_down) for entry in m.site_maps()]

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        shared = b.get("ffn")
        x_gate, x_up = b.get("gate", shared), b.get("up", shared)
        hidden = swiglu(self.w_gate.project(x_gate), self.w_up.project(x_up), self.w_gate.out_site,
                        self.w_up.out_site, self.w_gate.eps, self.w_gate.kernels)
        return self.w_down(hidden)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, scale: ScaleConfig):
        super().__init__()
        moe = cfg.moe is not None
        self.attn_norm = PreNorm(cfg, input_branches(scale, "attn"), scale)
        self.attn = Attention(cfg, scale)
        self.ffn_norm = PreNorm(cfg, input_branches(scale, "ffn", moe), scale)
        self.ffn = MoEFeedForward(cfg, scale) if moe else FeedForward(cfg, scale, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: Rotary, delta: torch.Tensor | None = None, mask=None,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is x + delta (the previous block's last update, added by this block's
        first norm); returns (h, the FFN's update) for the next norm to add. mask, positions: see
        Attention.forward."""
        a, x = self.attn_norm(x, delta)
        b, h = self.ffn_norm(x, self.attn(a, rope, mask, positions))
        return h, self.ffn(b)

    def site_maps(self) -> list[SiteMaps]:
        """Every site of the block with the maps it scales (folding, describe)."""
        found = [SiteMaps(site, "in", tuple(sub.input_maps(branch)))
                 for norm, sub in ((self.attn_norm, self.attn), (self.ffn_norm, self.ffn))
                 for branch, site in norm.sites.items()]
        return found + self.attn.site_maps() + self.ffn.site_maps()


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, scale: ScaleConfig):
        super().__init__()
        self.cfg, self.scale = cfg, scale
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg, scale) for _ in range(cfg.n_layers))
        self.final_norm = PreNorm(cfg, ["final"], scale)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._moe = {i: b.ffn for i, b in enumerate(self.layers) if isinstance(b.ffn, MoEFeedForward)}

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `tokens` [batch, seq]. doc_ids [batch, seq] (the loader's, docs/data.md) confine
        attention to documents under model.attention_mask=document; without them (or under causal)
        attention is causal over the row, which is the same for a row of one document."""
        if tokens.shape[-1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[-1]} tokens exceeds model.max_seq_len="
                             f"{self.cfg.max_seq_len}")
        mask = pos = None
        if doc_ids is not None and self.cfg.attention_mask == "document":
            mask = document_mask(doc_ids, backend_for(self.cfg.attention_backend, doc_ids.device))
            pos = positions(doc_ids) if self.cfg.rope_reset else None
        x, delta = self.tok_emb(tokens), None
        if torch.is_autocast_enabled(x.device.type):
            # The residual stream in the autocast dtype, as FSDP's bf16 parameters give it: one precision
            # regime on one process and on many (docs/architecture.md, "Precision").
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for layer in self.layers:
            x, delta = layer(x, self.rope, delta, mask, pos)
        x = self.final_norm(x, delta)[0]["final"]
        weight = self.tok_emb.weight if self.head is None else self.head.weight
        return F.linear(x, weight)

    def site_maps(self) -> list[SiteMaps]:
        """Every scale site with the maps it scales: what folding absorbs and what describe reports."""
        head = self.tok_emb.weight if self.head is None else self.head.weight
        found = [SiteMaps(self.final_norm.sites["final"], "in", (ScaledMap(head, None),))]
        for block in self.layers:
            found += block.site_maps()
        return found

    # The training loop's view of the MoE layers (it imports nothing from model/moe.py).
    def auxiliary_loss(self) -> torch.Tensor | None:
        """The weighted router losses of the last forward, to add to the training loss; None when the
        model has none (dense, or both MoE loss coefficients 0)."""
        losses = [m.aux_loss for m in self._moe.values() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def compute_metrics(self) -> dict[str, float]:
        """Metrics of the layers that keep them (MoE load balance), keys like moe/layer3/load_max."""
        out = {}
        for i, m in self._moe.items():
            out.update({f"moe/layer{i}/{k}": v for k, v in m.compute_metrics().items()})
        return out

    def register_optimizer_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Updates that follow each optimizer step: the MoE layers' expert biases (a collective: every
        rank steps the optimizer); not on a step the optimizer's `found_inf` skips."""
        for m in self._moe.values():
            def update(optimizer, args, kwargs, layer=m):
                found_inf = getattr(optimizer, "found_inf", None)
                layer.update_bias(None if found_inf is None else found_inf == 0)

            update.reads_found_inf = True  # training/skip.py then copies nothing to skip a step
            optimizer.register_step_post_hook(update)

    def discard_step_state(self) -> None:
        """Forget what the forwards of a step that is not taken recorded (the routers' token counts)."""
        for m in self._moe.values():
            m.token_counts.zero_()

    def initial_value(self, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
        """The initial value of parameter `name`: a function of (seed, name) only."""
        owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
        if isinstance(owner, ScaleSite):
            return owner.initial_value(name.rsplit(".", 1)[1], shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        std = self.cfg.init_std
        if name.endswith(("wo.weight", "w_down.weight")) or ".experts.w_down" in name:
            std /= math.sqrt(2 * self.cfg.n_layers)
        return torch.randn(shape, generator=gen) * std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialize every parameter and buffer in place (single device; parallel/data_parallel.py initializes
        sharded models with initial_value too)."""
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, p.shape, seed))
        self.init_buffers()

    def init_buffers(self) -> None:
        for m in self.modules():
            if m is not self and hasattr(m, "init_buffers"):
                m.init_buffers()

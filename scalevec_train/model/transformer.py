"""The decoder: Llama-style pre-norm blocks (RMSNorm, RoPE, grouped-query attention, SwiGLU or MoE),
with the scale sites of the strategy's plan (plan.py, built once here and handed to the layers by
part). A plain nn.Module: parallelism, precision and compilation are applied from outside; the
normalization kernels (model.kernels) are chosen when the layers are built.

    a = N(x) scaled per branch             (attn_norm: one site, or q/k/v sites under HG)
    q, k, v = Wq a_q, Wk a_k, Wv a_v       (each map may have an output norm and site: QK-norm, DNP)
    h = x + Wo SDPA(rope(q), rope(k), v)   (Wo may have input/output sites and a post-norm; causal,
                                            or within documents: masking.py)
    b = N(h) scaled per branch             (ffn_norm)
    y = h + Wdown (silu(Wgate b_g) * Wup b_u)
    logits = Whead (s_final * N(x_L))

Initialization (model.parameterization, parameterization.py): under sp, embeddings and every matrix
~ N(0, init_std), the maps that write into the residual stream (o, down) ~ N(0, init_std / sqrt(2 *
n_layers)); every scale site starts at s = 1. Values depend only on (seed, parameter name), never on
sharding. Under mup the init follows the width, and the logits, the attention logits and each
residual branch (h = x + m * ...) get the multipliers parameterization.py gives (all 1 under sp,
which skips them).
"""

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_train.model.config import ModelConfig, ScaleConfig
from scalevec_train.model.layers import Linear, PreNorm, Residual, Rotary
from scalevec_train.model.masking import attend, backend_for, document_mask, positions
from scalevec_train.model.moe import MoEFeedForward
from scalevec_train.model.parameterization import Parameterization
from scalevec_train.model.plan import AttentionPlan, BlockPlan, Branch, ScalePlan, SwiGLUPlan
from scalevec_train.model.strategies import ScaledMap, ScaleSite, SiteMaps
from scalevec_train.model.swiglu import SwiGLU


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: AttentionPlan):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = Linear(plan.q, cfg)
        self.wk = Linear(plan.k, cfg)
        self.wv = Linear(plan.v, cfg)
        self.wo = Linear(plan.o, cfg)
        self.scale = Parameterization.of(cfg).attention_scale
        # the pre-norm branches q, k and v read
        self.reads: tuple[Branch, Branch, Branch] = (plan.q.reads, plan.k.reads, plan.v.reads)

    def forward(self, a: dict[Branch, torch.Tensor], rope: Rotary, mask=None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """mask: None (causal) or document_mask's; positions: RoPE positions (None: 0..seq-1)."""
        q_in, k_in, v_in = self.reads
        q, k, v = self.wq(a[q_in]), self.wk(a[k_in]), self.wv(a[v_in])
        batch, seq, _ = q.shape
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = attend(rope(q, positions), rope(k, positions), v, mask,
                     self.n_kv_heads != self.n_heads, self.scale)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU (swiglu.py) on three Linear maps, which hold its sites."""

    def __init__(self, cfg: ModelConfig, plan: SwiGLUPlan):
        super().__init__()
        self.w_gate = Linear(plan.gate, cfg)
        self.w_up = Linear(plan.up, cfg)
        self.w_down = Linear(plan.down, cfg)
        self.reads: tuple[Branch, Branch] = (plan.gate.reads, plan.up.reads)
        self.swiglu = SwiGLU(plan.gate, plan.up, cfg)

    def forward(self, b: dict[Branch, torch.Tensor]) -> torch.Tensor:
        gate_in, up_in = self.reads
        hidden = self.swiglu(self.w_gate.project(b[gate_in]), self.w_up.project(b[up_in]),
                             self.w_gate.output_scale(), self.w_up.output_scale())
        return self.w_down(hidden)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: BlockPlan):
        super().__init__()
        self.attn_norm = PreNorm(plan.attn_norm, cfg)
        self.attn = Attention(cfg, plan.attn)
        self.ffn_norm = PreNorm(plan.ffn_norm, cfg)
        self.ffn = FeedForward(cfg, plan.ffn) if plan.moe is None else MoEFeedForward(cfg, plan.moe)
        self.branch = Parameterization.of(cfg).residual

    def forward(self, stream: Residual, rope: Rotary, mask=None,
                positions: torch.Tensor | None = None) -> Residual:
        """x + m attn(norm(x)), then h + m ffn(norm(h)) (m: the residual branches' multiplier, 1 but
        under mup's depth rule); mask, positions: see Attention.forward. Each sum is handed on as a
        Residual and formed by the next norm, in the fused pass that normalizes it."""
        a, x = self.attn_norm(stream)
        h = Residual(x, plus=self._branch(self.attn(a, rope, mask, positions)))
        b, h = self.ffn_norm(h)
        return Residual(h, plus=self._branch(self.ffn(b)))

    def _branch(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.branch == 1 else out * self.branch


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, scale: ScaleConfig):
        super().__init__()
        self.cfg, self.scale = cfg, scale
        self.plan = ScalePlan.build(cfg, scale)
        self.parameterization = Parameterization.of(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg, block) for block in self.plan.blocks)
        self.final_norm = PreNorm(self.plan.final_norm, cfg)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._moe = {i: b.ffn for i, b in enumerate(self.layers)
                     if isinstance(b.ffn, MoEFeedForward)}

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `tokens` [batch, seq]. doc_ids [batch, seq] (the loader's, docs/guides/data.md)
        confine attention to documents under model.attention_mask=document; without them (or under
        causal) attention is causal over the row, which is the same for a row of one document."""
        if tokens.shape[-1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[-1]} tokens exceeds model.max_seq_len="
                             f"{self.cfg.max_seq_len}")
        mask = pos = None
        if doc_ids is not None and self.cfg.attention_mask == "document":
            mask = document_mask(doc_ids, backend_for(self.cfg.attention_backend, doc_ids.device))
            pos = positions(doc_ids) if self.cfg.rope_reset else None
        x = self.tok_emb(tokens)
        if torch.is_autocast_enabled(x.device.type):
            # The residual stream in the autocast dtype, as FSDP's bf16 parameters give it: one
            # precision regime on one process and on many (docs/concepts/architecture.md,
            # "Precision").
            x = x.to(torch.get_autocast_dtype(x.device.type))
        stream = Residual(x)
        for layer in self.layers:
            stream = layer(stream, self.rope, mask, pos)
        final = self.final_norm(stream)[0][Branch.FINAL]
        if self.parameterization.readout != 1:
            # on the width, cheaper than on the vocabulary
            final = final * self.parameterization.readout
        weight = self.tok_emb.weight if self.head is None else self.head.weight
        return F.linear(final, weight)

    def site_maps(self) -> list[SiteMaps]:
        """Every scale site with the maps it scales, as the plan's rows say (diagnostics' input-side
        scales)."""
        return [SiteMaps(self.get_submodule(row.path), row.side,
                         tuple(ScaledMap(self.get_parameter(m.weight), m.norm and m.norm.label)
                               for m in row.maps),
                         row.cancelled_by) for row in self.plan.rows]

    # The training loop's view of the MoE layers (it imports nothing from model/moe.py).
    def auxiliary_loss(self) -> torch.Tensor | None:
        """The weighted router losses of the last forward, to add to the training loss; None when
        the model has none (dense, or both MoE loss coefficients 0)."""
        losses = [m.aux_loss for m in self._moe.values() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def compute_metrics(self) -> dict[str, float]:
        """Metrics of the layers that keep them (MoE load balance), keys like
        moe/layer3/load_max."""
        out = {}
        for i, m in self._moe.items():
            out.update({f"moe/layer{i}/{k}": v for k, v in m.compute_metrics().items()})
        return out

    def update_after_step(self, taken: torch.Tensor | None = None) -> None:
        """What follows each optimizer step: the MoE layers' expert-bias update (a collective: every
        rank calls it); where the 0-dim bool `taken` is false (a step skipped on the device),
        nothing changes."""
        for m in self._moe.values():
            m.update_bias(taken)

    def discard_step_state(self) -> None:
        """Forget what the forwards of a step that is not taken recorded (the routers' token
        counts)."""
        for m in self._moe.values():
            m.token_counts.zero_()

    def initial_value(self, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
        """The initial value of parameter `name`: a function of (seed, name) only."""
        owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
        if isinstance(owner, ScaleSite):
            return owner.initial_value(name.rsplit(".", 1)[1], shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        p = self.parameterization
        return torch.randn(shape, generator=gen) * p.init(name, p.kind(name, ()))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialize every parameter and buffer in place (single device; parallel/data_parallel.py
        initializes sharded models with initial_value too)."""
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, p.shape, seed))
        self.init_buffers()

    def init_buffers(self) -> None:
        """Initialize the buffers in place (after the parameters, also under FSDP)."""
        for m in self.modules():
            if m is not self and hasattr(m, "init_buffers"):
                m.init_buffers()

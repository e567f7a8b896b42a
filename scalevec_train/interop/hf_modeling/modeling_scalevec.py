"""A scalevec decoder, folded for inference, as a transformers model (`trust_remote_code=True`).

scalevec's exporter writes this file next to the weights of models whose folded form is not a stock
Llama: models with normalizations on linear-map outputs (scale strategies dnp/unified, QK-norm,
post-norms) and mixture-of-experts models. Its only dependencies are torch and transformers.

    a = g_in * N(x)                                      N(x) = x / sqrt(mean(x^2) + eps), in fp32
    q, k, v = W_q a, W_k a, W_v a                        each optionally w * N_h(.) per head
    h = x + W_o attention(rope(q), rope(k), v)           optionally w_o * N(.) on the output
    b = g_post * N(h)
    y = h + mlp(b)                                       SwiGLU or mixture of experts, optionally
                                                         w_gate/w_up * N(.) inside, w_down * N(.)
                                                         after
    logits = W_head (g_final * N(x_L))

Which of these output norms exist, and the shape of their weights, is the exported model's scale
plan (`config.scale_plan`, one row per scale site of the folded model): every row that names a
`weight` is the weight of a normalization at that place, per attention head where the row says
`per_head`; a weight of [experts, width] holds one row per routed expert, which the experts apply to
their own outputs (each normalized over the expert's hidden width). Inside a mixture-of-experts
layer the shared expert has its own gate/up norms; the down norm acts on the combined output.

RoPE rotates halves (the Llama layout). Mixture of experts: fp32 router logits, softmax or sigmoid
scores, the top-k experts chosen on scores + expert_bias (the bias only chooses), routing weights
optionally renormalized over the k chosen, every expert a SwiGLU with weights stored as
[experts, out, in], plus an optional shared SwiGLU every token passes through.

The model computes the whole sequence on every forward (no key/value cache): generation works but
recomputes the prefix at every new token.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast


class ScalevecConfig(PretrainedConfig):
    model_type = "scalevec"

    def __init__(self, vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=None,
                 max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6, scale_plan=(),
                 moe=None, initializer_range=0.02, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        # scalevec's scale plan of the folded model: a row per scale site; a row with a `weight`
        # (its name here), its `shape` and `per_head` is a normalization's weight, the others folded
        # into the matrices
        self.scale_plan = list(scale_plan)
        # None for dense layers, else: num_experts, top_k, expert_dim, shared_expert_dim (0: none),
        # score_func (softmax | sigmoid), renormalize
        self.moe = moe
        self.initializer_range = initializer_range
        # The exporter always writes lm_head.weight, so no version of transformers has to tie
        # weights.
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class ScalevecRMSNorm(nn.Module):
    """RMSNorm over the last dimension, or per attention head of `head_dim` channels; the weight has
    either the full width or one head's width (shared by the heads). A weight of size
    (experts, width) holds one row per routed expert; the experts apply their own row."""

    def __init__(self, size: int | tuple[int, ...], eps: float, head_dim: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.head_dim = eps, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head_dim is None:
            return rms_norm(x, self.weight, self.eps)
        weight = self.weight.view(-1, self.head_dim)
        return rms_norm(x.unflatten(-1, (-1, self.head_dim)), weight, self.eps).flatten(-2)


def output_norms(config: ScalevecConfig, layer: int) -> dict[str, ScalevecRMSNorm]:
    """{module name within decoder layer `layer` (self_attn.q_norm, mlp.experts.gate_norm, ...): the
    normalization} for every row of the scale plan that names a weight there."""
    prefix = f"model.layers.{layer}."
    return {row["weight"].removeprefix(prefix).removesuffix(".weight"):
            ScalevecRMSNorm(tuple(row["shape"]), config.rms_norm_eps,
                            config.head_dim if row["per_head"] else None)
            for row in config.scale_plan if row["weight"] and row["weight"].startswith(prefix)}


def _normed(norm: ScalevecRMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [..., seq, head_dim] for integer positions [..., seq] (computed in float64)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                            device=positions.device)
                               / head_dim)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class ScalevecAttention(nn.Module):
    def __init__(self, config: ScalevecConfig, norms: dict[str, ScalevecRMSNorm]):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads,
                                                        config.num_key_value_heads, config.head_dim)
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=False)
        self.q_norm, self.k_norm, self.v_norm, self.o_norm = (norms.get(f"self_attn.{n}_norm")
                                                              for n in "qkvo")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = _normed(self.q_norm, self.q_proj(x)).view(batch, seq, self.n_heads,
                                                      self.head_dim).transpose(1, 2)
        k = _normed(self.k_norm, self.k_proj(x)).view(batch, seq, self.n_kv_heads,
                                                      self.head_dim).transpose(1, 2)
        v = _normed(self.v_norm, self.v_proj(x)).view(batch, seq, self.n_kv_heads,
                                                      self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return _normed(self.o_norm, self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1)))


class ScalevecMLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x), with the output norms of `norms` named
    `prefix` + gate_norm, up_norm, down_norm (the shared expert of an MoE layer, prefix mlp.shared.,
    has no down norm of its own: its output is normalized together with the experts')."""

    def __init__(self, config: ScalevecConfig, hidden: int, norms: dict[str, ScalevecRMSNorm],
                 prefix: str):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, hidden, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, config.hidden_size, bias=False)
        self.gate_norm, self.up_norm, self.down_norm = (norms.get(f"{prefix}{n}_norm")
                                                        for n in ("gate", "up", "down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = _normed(self.gate_norm, self.gate_proj(x))
        up = _normed(self.up_norm, self.up_proj(x))
        return _normed(self.down_norm, self.down_proj(F.silu(gate) * up))


class ScalevecExperts(nn.Module):
    """The routed SwiGLU experts as weight stacks [experts, out, in]."""

    def __init__(self, config: ScalevecConfig, norms: dict[str, ScalevecRMSNorm]):
        super().__init__()
        moe, dim = config.moe, config.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(moe["num_experts"], moe["expert_dim"], dim))
        self.up_proj = nn.Parameter(torch.empty(moe["num_experts"], moe["expert_dim"], dim))
        self.down_proj = nn.Parameter(torch.empty(moe["num_experts"], dim, moe["expert_dim"]))
        self.gate_norm, self.up_norm = (norms.get("mlp.experts.gate_norm"),
                                        norms.get("mlp.experts.up_norm"))

    def _branch(self, norm: ScalevecRMSNorm | None, y: torch.Tensor, expert: int) -> torch.Tensor:
        return y if norm is None else rms_norm(y, norm.weight[expert], norm.eps)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, dim]; chosen, weights [tokens, k] -> sum_j weights_j E_{chosen_j}(x), fp32."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.gate_proj.shape[0]):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            xe = x[token]
            gate = self._branch(self.gate_norm, F.linear(xe, self.gate_proj[e]), e)
            hidden = F.silu(gate) * self._branch(self.up_norm, F.linear(xe, self.up_proj[e]), e)
            hidden = hidden * weights[token, slot].unsqueeze(-1).to(hidden.dtype)
            out.index_add_(0, token, F.linear(hidden, self.down_proj[e]).float())
        return out


class ScalevecMoE(nn.Module):
    def __init__(self, config: ScalevecConfig, norms: dict[str, ScalevecRMSNorm]):
        super().__init__()
        self.moe = config.moe
        self.router = nn.Linear(config.hidden_size, self.moe["num_experts"], bias=False)
        self.experts = ScalevecExperts(config, norms)
        # The load-balancing bias learned in training: it shifts which experts are chosen, never the
        # weights.
        self.register_buffer("expert_bias", torch.zeros(self.moe["num_experts"]))
        shared = self.moe.get("shared_expert_dim") or 0
        self.shared = ScalevecMLP(config, shared, norms, "mlp.shared.") if shared else None
        self.down_norm = norms.get("mlp.down_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat.float(), self.router.weight.float())
        scores = logits.softmax(-1) if self.moe["score_func"] == "softmax" else logits.sigmoid()
        chosen = (scores + self.expert_bias.float()).topk(self.moe["top_k"], dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.moe["renormalize"]:
            weights = weights / weights.sum(-1, keepdim=True)
        y = self.experts(flat, chosen, weights)
        if self.shared is not None:
            y = y + self.shared(flat).float()
        return _normed(self.down_norm, y).to(x.dtype).view(x.shape)


class ScalevecDecoderLayer(nn.Module):
    def __init__(self, config: ScalevecConfig, layer: int):
        super().__init__()
        norms = output_norms(config, layer)
        self.input_layernorm = ScalevecRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ScalevecAttention(config, norms)
        self.post_attention_layernorm = ScalevecRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (ScalevecMoE(config, norms) if config.moe
                    else ScalevecMLP(config, config.intermediate_size, norms, "mlp."))

    def forward(self, x, cos, sin, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class ScalevecModel(nn.Module):
    def __init__(self, config: ScalevecConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ScalevecDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = ScalevecRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        seq = input_ids.shape[-1]
        mask = None
        if attention_mask is None or bool(attention_mask.all()):
            positions = torch.arange(seq, device=input_ids.device)
            cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        else:
            # Padding (left or right): real tokens keep positions 0, 1, ... and attend to real
            # tokens only.
            keep = attention_mask.bool()
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            # A padding query attends to itself so that its (unused) row is never all -inf.
            mask = (causal & keep[:, None, None, :]) | torch.eye(seq, dtype=torch.bool,
                                                                 device=x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class ScalevecForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ScalevecConfig
    base_model_prefix = "model"
    _no_split_modules = ["ScalevecDecoderLayer"]

    def __init__(self, config: ScalevecConfig):
        super().__init__(config)
        self.model = ScalevecModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, ScalevecExperts):
            for p in module.parameters():
                nn.init.normal_(p, std=std)
        elif isinstance(module, ScalevecRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, ScalevecMoE):
            nn.init.zeros_(module.expert_bias)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        logits = self.lm_head(self.model(input_ids, attention_mask))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask=None,
                                      **kwargs) -> dict:
        # No cache: every step sees the whole sequence.
        return {"input_ids": input_ids, "attention_mask": attention_mask}

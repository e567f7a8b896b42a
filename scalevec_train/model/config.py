"""The model's options: the decoder's shape and its mixture-of-experts layers (`model.*` in the
config), and the scale-vector strategy (`scale.*`; model/plan.py decides its sites)."""

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from scalevec_kernels import BACKENDS
from scalevec_train.infra.errors import ScalevecError, check_choices, choice

# options that change how the model computes, not its weights
COMPUTE_ONLY = ("kernels", "attention_mask", "rope_reset", "attention_backend", "fp8", "fp8_filter",
                "fp8_keep")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class MoEConfig:
    # routed experts per MoE layer
    num_experts: int = 8
    # experts each token is sent to
    top_k: int = 2
    # hidden width of each routed expert's SwiGLU (a multiple of 8 lets grouped_mm run)
    expert_dim: int = 256
    # shared experts every token passes through, added to the routed output; 0 = none
    num_shared_experts: int = 0
    # hidden width of each shared expert; null = model.ffn_dim
    shared_expert_dim: int | None = None
    # router scores: softmax (over the experts) | sigmoid (each expert on its own)
    score_func: str = choice("softmax", Literal["softmax", "sigmoid"])
    # rescale each token's top-k scores to sum to 1
    renormalize: bool = True
    # expert-bias step per optimizer step: bias += rate * sign(mean load - load); 0 disables
    bias_update_rate: float = 1e-3
    # weight of the load-balancing loss E * sum_e f_e P_e in the training loss; 0 disables
    aux_loss_coef: float = 0.0
    # weight of the router z-loss mean(logsumexp(logits)^2) in the training loss; 0 disables
    z_loss_coef: float = 0.0
    # expert matmuls: auto (grouped_mm where supported, else loop) | grouped_mm | loop
    backend: str = choice("auto", Literal["auto", "grouped_mm", "loop"])

    def validate(self, dim: int) -> None:
        check_choices(self, "model.moe.")
        for key in ("num_experts", "expert_dim"):
            if getattr(self, key) <= 0:
                raise ScalevecError(f"model.moe.{key}",
                                    f"must be positive, got {getattr(self, key)}.")
        if not 0 < self.top_k <= self.num_experts:
            raise ScalevecError("model.moe.top_k", f"{self.top_k} is outside [1, num_experts="
                                f"{self.num_experts}].", "pick top_k between 1 and num_experts.")
        if self.top_k == 1 and self.renormalize:
            raise ScalevecError("model.moe.renormalize",
                                "with top_k=1 renormalizing makes every routing "
                                "weight 1, so the router would learn nothing from the loss.",
                                "set model.moe.renormalize=false or top_k > 1.")
        if self.num_shared_experts < 0:
            raise ScalevecError("model.moe.num_shared_experts",
                                f"must be >= 0, got {self.num_shared_experts}.")
        if self.shared_expert_dim is not None and self.shared_expert_dim <= 0:
            raise ScalevecError("model.moe.shared_expert_dim", f"must be positive or null, got "
                                f"{self.shared_expert_dim}.")
        for key in ("bias_update_rate", "aux_loss_coef", "z_loss_coef"):
            if getattr(self, key) < 0:
                raise ScalevecError(f"model.moe.{key}",
                                    f"must not be negative, got {getattr(self, key)}.")
        if self.backend == "grouped_mm":
            if not hasattr(torch, "_grouped_mm"):
                raise ScalevecError("model.moe.backend",
                                    f"torch {torch.__version__} has no _grouped_mm.",
                                    "use model.moe.backend=auto or loop, or a newer torch.")
            if dim % 8 or self.expert_dim % 8:
                raise ScalevecError("model.moe.backend",
                                    f"grouped_mm needs 16-byte aligned rows, so model.dim={dim} "
                                    f"and expert_dim={self.expert_dim} must be multiples of 8.",
                                    "use model.moe.backend=auto (it falls back to loop) or "
                                    "multiples of 8.")


@dataclass
class ModelConfig:
    # preset name, used in run names
    name: str = "dense-tiny"
    # residual stream width
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    # key/value heads for grouped-query attention; must divide n_heads
    n_kv_heads: int = 4
    # SwiGLU hidden width (dense layers and the shared expert's default)
    ffn_dim: int = 688
    # must be >= the tokenizer's vocab size
    vocab_size: int = 4096
    # longest sequence RoPE tables are built for
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # per-head RMSNorm of q and k with an output scale site (docs/concepts/scale-vectors.md's g_q,
    # g_k)
    qk_norm: bool = False
    # Gemma/OLMo-2 style normalization of each sub-layer's output (docs/concepts/scale-vectors.md's
    # g_o, g_down)
    post_norm: bool = False
    # share the token embedding with the output head
    tie_embeddings: bool = True
    # std of the normal init of embeddings and matrices (see the module docstring)
    init_std: float = 0.02
    # null for a dense model; see MoEConfig for the options (model/moe.py documents the layer)
    moe: MoEConfig | None = None
    # attention over the training window: causal (every earlier token, across document boundaries) |
    # document (only the earlier tokens of the same document; the loader gives the boundaries, and
    # the target after each EOS is not counted: docs/guides/data.md). Changes no weight.
    attention_mask: str = choice("causal", Literal["causal", "document"])
    # under attention_mask=document, RoPE positions restart at 0 at each document start (Megatron's
    # reset_position_ids); false: positions count from the window's start
    rope_reset: bool = False
    # kernel of document-masked attention: auto (FlexAttention on CUDA, dense-mask SDPA elsewhere) |
    # flex (block-sparse FlexAttention, compiled; CUDA only for training: torch has no CPU backward)
    # | sdpa (SDPA with a dense [seq, seq] mask per sequence: the reference)
    attention_backend: str = choice("auto", Literal["auto", "flex", "sdpa"])
    # normalization kernels, chosen when the layers are built: auto (Triton on CUDA, PyTorch
    # elsewhere; under distributed.compile, per op and shape, the Triton kernel or torch.compile's
    # code of the reference, whichever the latest measurements on a GPU found faster:
    # scalevec_kernels/choice.py, the picks in docs/benchmarks/2026-11-26-h200.md) | triton | torch.
    # Changes no weight: a checkpoint resumes under any backend.
    kernels: str = choice("auto", Literal[BACKENDS])
    # FP8 matmuls in the block maps (q, k, v, o, gate, up, down), through torchao's float8 training
    # (parallel/fp8.py): none | tensorwise (one scale per tensor; under FSDP2 on NCCL the weights
    # are all-gathered in FP8) | rowwise (a scale per row, rounded to a power of 2) |
    # rowwise_with_gw_hp (rowwise, with the weight gradient's matmul in high precision). The
    # embedding, the head, the routers, MoE experts and every scale site keep their precision.
    # Emulated on a CPU. Changes no weight
    fp8: str = choice("none", Literal[("none", *FP8_RECIPES)])
    # which block maps model.fp8 converts: auto (dims divisible by 16 and above torchao's size
    # thresholds for the recipe, below which FP8 was slower than bf16 on an H100) | all (every map
    # whose dims divide by 16)
    fp8_filter: str = choice("auto", Literal["auto", "all"])
    # block maps (q, k, v, o, gate, up, down) kept in bf16 under model.fp8 whatever the filter
    # says: e.g. [down], whose input carries unified's outliers
    # (docs/results/what-fp8-does-to-scale-vectors.md)
    fp8_keep: list[str] = field(default_factory=list)
    # how the init, the learning rates and the forward's multipliers follow width and depth
    # (docs/concepts/parameterization.md): sp (one init std and one LR at every size) | mup (muP for
    # width, Tensor Programs V; CompleteP for depth, Dey et al. 2025: an LR tuned at the base shape
    # below carries over)
    parameterization: str = choice("sp", Literal["sp", "mup"])
    # mup only: the width (model.dim) of the base model the LR is tuned at; null: dim (this model is
    # the base)
    base_dim: int | None = None
    # mup only: the depth (model.n_layers) of the base model; null: n_layers
    base_layers: int | None = None
    # mup only: the base model's head width; attention logits are scaled by sqrt(base_head_dim) /
    # head_dim (muP's 1 / head_dim, equal to sp's 1 / sqrt(head_dim) at the base); null: head_dim,
    # right wherever the head width stays fixed as the model grows (the ladders grow by heads)
    base_head_dim: int | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def non_embedding_params(self) -> int:
        """N of `train.tokens_per_param` and of the ladder's size rule, from the shapes alone (no
        model is built): the matrices a token multiplies with, MoE's routed experts counted top_k /
        num_experts, without the embedding, the head and the scale sites (costs/accounting.py gives
        the reasons, and its count from a built model is the one tests/model/test_ladder.py holds
        this to)."""
        hd = self.head_dim
        attention = self.dim * hd * 2 * (self.n_heads + self.n_kv_heads)
        if self.moe is None:
            ffn = 3 * self.dim * self.ffn_dim
        else:
            m = self.moe
            shared = m.num_shared_experts * (m.shared_expert_dim or self.ffn_dim)
            ffn = m.num_experts * self.dim + 3 * self.dim * (m.top_k * m.expert_dim + shared)
        return self.n_layers * (attention + ffn)

    def validate(self) -> None:
        check_choices(self, "model.")
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                    "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ScalevecError(f"model.{key}", f"must be positive, got {getattr(self, key)}.")
        if self.dim % self.n_heads:
            raise ScalevecError("model.dim", f"hidden size {self.dim} is not divisible by "
                                f"model.n_heads={self.n_heads}.", "pick n_heads dividing dim.")
        if self.head_dim % 2:
            raise ScalevecError("model.n_heads",
                                f"head_dim={self.head_dim} is odd; RoPE needs it even.",
                                "change dim or n_heads.")
        if self.n_heads % self.n_kv_heads:
            raise ScalevecError("model.n_kv_heads", f"{self.n_kv_heads} does not divide "
                                f"n_heads={self.n_heads}.", "use a divisor of n_heads.")
        if self.rope_reset and self.attention_mask != "document":
            raise ScalevecError("model.rope_reset",
                                "resets positions at document starts, which only "
                                "attention_mask=document knows.",
                                "set model.attention_mask=document, or model.rope_reset=false.")
        if self.moe is not None:
            self.moe.validate(self.dim)
        unknown = [m for m in self.fp8_keep if m not in ATTN_MAPS + FFN_MAPS]
        if unknown:
            raise ScalevecError("model.fp8_keep", f"unknown block maps {unknown}.",
                                f"name maps among {', '.join(ATTN_MAPS + FFN_MAPS)}.")
        for key in ("base_dim", "base_layers", "base_head_dim"):
            value = getattr(self, key)
            if value is None:
                continue
            if self.parameterization != "mup":
                raise ScalevecError(f"model.{key}", f"is set ({value}) but only "
                                    "model.parameterization=mup reads it.",
                                    f"set model.parameterization=mup, or model.{key}=null.")
            if value <= 0:
                raise ScalevecError(f"model.{key}", f"must be positive, got {value}.",
                                    "use a positive size or null.")

    def architecture(self) -> dict:
        """The options that decide the weights (what a checkpoint must match): all but the kernels
        and the attention mask (the same weights serve either mask)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in COMPUTE_ONLY}


def architecture_diff(a: dict, b: dict) -> list[str]:
    """The keys on which two architecture() records differ. A record written before an option
    existed lacks it, and ran with the behaviour the option's default keeps: a missing key counts as
    its default."""
    defaults = {k: v for k, v in dataclasses.asdict(ModelConfig()).items() if k not in COMPUTE_ONLY}
    moe = dataclasses.asdict(MoEConfig())

    def full(record: dict) -> dict:
        out = {**defaults, **record}
        if isinstance(out.get("moe"), dict):
            out["moe"] = {**moe, **out["moe"]}
        return out

    a, b = full(a), full(b)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


Param = Literal["plain", "or", "er", "fixed"]
PARAMS = get_args(Param)
# The linear maps of a block that placement targets can name.
ATTN_MAPS = ("q", "k", "v", "o")
FFN_MAPS = ("gate", "up", "down")
# The maps that read a pre-norm's output: the default placement targets.
PRE_NORM_MAPS = ("q", "k", "v", "gate", "up")


@dataclass
class ScaleConfig:
    # preset name; used in run names and for grouping runs
    name: str = "baseline"
    # shared: one pre-norm scale feeds q/k/v (and gate/up); per_branch: one input site per branch
    # (HG)
    heterogeneity: str = choice("shared", Literal["shared", "per_branch"])
    # MoE only, with per_branch: every expert gets its own gate/up input sites
    per_expert: bool = False
    # pre: scales only before the maps; dual: also an output-side site on each target map (DP);
    # dual_norm: the output-side site sits behind a normalization (DNP)
    placement: str = choice("pre", Literal["pre", "dual", "dual_norm"])
    # the linear maps that get dual placement: any of q, k, v, o, gate, up, down. The default is the
    # pre-norm maps (docs/concepts/scale-vectors.md, revision 2); [q, k, o, down] is revision 1's
    # reading (QK-norm + post-norms)
    targets: list[str] = field(default_factory=lambda: list(PRE_NORM_MAPS))
    # shape of the sites behind per-head normalizations (q, k, v): head_dim (shared by heads) | full
    head_site_shape: str = choice("head_dim", Literal["head_dim", "full"])
    # the normalization dual_norm puts behind q, k and v: head (N_h, per attention head) | full (N
    # over the map's whole output, its site as wide). The model's own QK-norm stays per head
    qkv_norm: str = choice("head", Literal["head", "full"])
    # plain: s = p; or: s = beta * alpha / rms(alpha); er: s = exp(b) * alpha / rms(alpha);
    # fixed: s = 1 with no parameter (the removal ablation)
    reparam: str = choice("plain", Param)
    # which sites `reparam` applies to (the others are plain): all | input | output
    reparam_sites: str = choice("all", Literal["all", "input", "output"])
    # weight decay on scale parameters: none | all | iwd (input sites only)
    weight_decay: str = choice("none", Literal["none", "all", "iwd"])
    # what decay does to an or/er site: magnitude (shrink s by (1 - lr*wd) per step: beta scaled, b
    # shifted by log(1 - lr*wd), alpha untouched) | all_params (revision 1: the optimizer's decay on
    # beta or b and on alpha)
    reparam_decay: str = choice("magnitude", Literal["magnitude", "all_params"])
    # whether the policy's decay (iwd or all) reaches the final norm's site, whose scale sets the
    # logits' (of a tied head too); false: that site never decays
    decay_final_norm: bool = True

    def validate(self) -> None:
        check_choices(self, "scale.")
        unknown = [t for t in self.targets if t not in ATTN_MAPS + FFN_MAPS]
        if unknown:
            raise ScalevecError("scale.targets", f"unknown linear maps {unknown}.",
                                f"choose among {', '.join(ATTN_MAPS + FFN_MAPS)}.")
        if self.per_expert and self.heterogeneity != "per_branch":
            raise ScalevecError("scale.per_expert", "per-expert sites need branch-specific scales.",
                                "set scale.heterogeneity=per_branch or scale.per_expert=false.")

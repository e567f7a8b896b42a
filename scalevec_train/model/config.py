"""The model's options: the decoder's shape and its mixture-of-experts layers (`model.*` in the config)."""

import dataclasses
from dataclasses import dataclass

import torch

from scalevec_kernels import BACKENDS
from scalevec_train.errors import ScalevecError

SCORE_FUNCS = ("softmax", "sigmoid")
EXPERT_BACKENDS = ("auto", "grouped_mm", "loop")
ATTENTION_MASKS = ("causal", "document")
ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
# options that change how the model computes, not its weights
COMPUTE_ONLY = ("kernels", "attention_mask", "rope_reset", "attention_backend")


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
    score_func: str = "softmax"
    # rescale each token's top-k scores to sum to 1
    renormalize: bool = True
    # expert-bias step per optimizer step: bias += rate * sign(mean load - load); 0 disables
    bias_update_rate: float = 1e-3
    # weight of the load-balancing loss E * sum_e f_e P_e in the training loss; 0 disables
    aux_loss_coef: float = 0.0
    # weight of the router z-loss mean(logsumexp(logits)^2) in the training loss; 0 disables
    z_loss_coef: float = 0.0
    # expert matmuls: auto (grouped_mm where supported, else loop) | grouped_mm | loop
    backend: str = "auto"

    def validate(self, dim: int) -> None:
        for key in ("num_experts", "expert_dim"):
            if getattr(self, key) <= 0:
                raise ScalevecError(f"model.moe.{key}", f"must be positive, got {getattr(self, key)}.")
        if not 0 < self.top_k <= self.num_experts:
            raise ScalevecError("model.moe.top_k", f"{self.top_k} is outside [1, num_experts="
                                f"{self.num_experts}].", "pick top_k between 1 and num_experts.")
        if self.top_k == 1 and self.renormalize:
            raise ScalevecError("model.moe.renormalize", "with top_k=1 renormalizing makes every routing "
                                "weight 1, so the router would learn nothing from the loss.",
                                "set model.moe.renormalize=false or top_k > 1.")
        if self.num_shared_experts < 0:
            raise ScalevecError("model.moe.num_shared_experts",
                                f"must be >= 0, got {self.num_shared_experts}.")
        if self.shared_expert_dim is not None and self.shared_expert_dim <= 0:
            raise ScalevecError("model.moe.shared_expert_dim", f"must be positive or null, got "
                                f"{self.shared_expert_dim}.")
        if self.score_func not in SCORE_FUNCS:
            raise ScalevecError("model.moe.score_func", f"unknown value {self.score_func!r}.",
                                f"use one of: {', '.join(SCORE_FUNCS)}.")
        if self.backend not in EXPERT_BACKENDS:
            raise ScalevecError("model.moe.backend", f"unknown value {self.backend!r}.",
                                f"use one of: {', '.join(EXPERT_BACKENDS)}.")
        for key in ("bias_update_rate", "aux_loss_coef", "z_loss_coef"):
            if getattr(self, key) < 0:
                raise ScalevecError(f"model.moe.{key}", f"must not be negative, got {getattr(self, key)}.")
        if self.backend == "grouped_mm":
            if not hasattr(torch, "_grouped_mm"):
                raise ScalevecError("model.moe.backend", f"torch {torch.__version__} has no _grouped_mm.",
                                    "use model.moe.backend=auto or loop, or a newer torch.")
            if dim % 8 or self.expert_dim % 8:
                raise ScalevecError("model.moe.backend", f"grouped_mm needs 16-byte aligned rows, so "
                                    f"model.dim={dim} and expert_dim={self.expert_dim} must be multiples "
                                    "of 8.", "use model.moe.backend=auto (it falls back to loop) or "
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
    # per-head RMSNorm of q and k with an output scale site (the spec's g_q, g_k)
    qk_norm: bool = False
    # Gemma/OLMo-2 style normalization of each sub-layer's output (the spec's g_o, g_down)
    post_norm: bool = False
    # share the token embedding with the output head
    tie_embeddings: bool = True
    # std of the normal init of embeddings and matrices (see the module docstring)
    init_std: float = 0.02
    # null for a dense model; see MoEConfig for the options (model/moe.py documents the layer)
    moe: MoEConfig | None = None
    # attention over the training window: causal (every earlier token, across document boundaries) |
    # document (only the earlier tokens of the same document; the loader gives the boundaries, and the
    # target after each EOS is not counted: docs/data.md). Changes no weight.
    attention_mask: str = "causal"
    # under attention_mask=document, RoPE positions restart at 0 at each document start (Megatron's
    # reset_position_ids); false: positions count from the window's start
    rope_reset: bool = False
    # kernel of document-masked attention: auto (FlexAttention on CUDA, dense-mask SDPA elsewhere) |
    # flex (block-sparse FlexAttention, compiled; CUDA only for training: torch has no CPU backward) |
    # sdpa (SDPA with a dense [seq, seq] mask per sequence: the reference)
    attention_backend: str = "auto"
    # normalization kernels, chosen when the layers are built: auto (Triton on CUDA, PyTorch
    # elsewhere) | triton | torch. Changes no weight: a checkpoint resumes under any backend.
    kernels: str = "auto"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ScalevecError(f"model.{key}", f"must be positive, got {getattr(self, key)}.")
        if self.dim % self.n_heads:
            raise ScalevecError("model.dim", f"hidden size {self.dim} is not divisible by "
                                f"model.n_heads={self.n_heads}.", "pick n_heads dividing dim.")
        if self.head_dim % 2:
            raise ScalevecError("model.n_heads", f"head_dim={self.head_dim} is odd; RoPE needs it even.",
                                "change dim or n_heads.")
        if self.n_heads % self.n_kv_heads:
            raise ScalevecError("model.n_kv_heads", f"{self.n_kv_heads} does not divide "
                                f"n_heads={self.n_heads}.", "use a divisor of n_heads.")
        if self.kernels not in BACKENDS:
            raise ScalevecError("model.kernels", f"unknown value {self.kernels!r}.",
                                f"use one of: {', '.join(BACKENDS)}.")
        for key, allowed in (("attention_mask", ATTENTION_MASKS), ("attention_backend", ATTENTION_BACKENDS)):
            if getattr(self, key) not in allowed:
                raise ScalevecError(f"model.{key}", f"unknown value {getattr(self, key)!r}.",
                                    f"use one of: {', '.join(allowed)}.")
        if self.rope_reset and self.attention_mask != "document":
            raise ScalevecError("model.rope_reset", "resets positions at document starts, which only "
                                "attention_mask=document knows.", "set model.attention_mask=document, or "
                                "model.rope_reset=false.")
        if self.moe is not None:
            self.moe.validate(self.dim)

    def architecture(self) -> dict:
        """The options that decide the weights (what a checkpoint must match): all but the kernels and
        the attention mask (the same weights serve either mask)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in COMPUTE_ONLY}

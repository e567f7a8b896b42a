"""The paper's mechanism, measured (train.diagnostics_every; docs/guides/experiments.md,
"Diagnostics"): what the diagnostics callback records, as functions of the model. Every value is a
0-dim fp32 tensor on the device, keyed `diag/layer<i>/<what>/<stat>` (`diag/final/...`,
`diag/head/...` outside the blocks).

Weights (map_stats), per linear map W [out, in] (an expert stack [E, out, in]: every expert's
columns count as columns) and its input-side scale g, the product of the learnable sites that
multiply its input (the pre-norm's site or its HG branch's, the map's own input site, an expert's
own; the model's site_maps() says which, as for folding):
    c_j = ||W[:, j]||          the map's own column norms
    e_j = |g_j| c_j            the column norms of W diag(g), the map as its input sees it
    weight_rms                 RMS of W's entries
    update_ratio               ||W - W_before||_F / ||W_before||_F over the step (0 for a skipped
                               step)
    col_rms, col_cv            RMS of c, and its spread std(c) / mean(c)
    eff_col_rms, eff_col_cv    the same of e                                 } only for a map
                                                                               that has
    col_gain                   eff_col_rms / col_rms: what g adds to the map } an input-side scale
    g_col_corr                 Pearson correlation of |g_j| and c_j over the columns (0 where either
                               is constant)
Under gradient flow the column j of W diag(g) moves with the preconditioner g_j^2 I + w_j w_j^T
(docs/concepts/scale-vectors.md): a spread of e beyond that of c, and a positive correlation of g
with c, are the self-amplification the paper describes. Sharded (DTensor) weights are reduced by
DTensor's own collectives, so every rank computes the same values on any mesh, from the fp32 shards.

Scale sites (site_stats), per learnable site, of its vector s as the model applies it (an or/er
site's beta * alpha / rms(alpha): its scale_rms is the magnitude beta):
    scale_rms, scale_mean      RMS and mean of s
    scale_update_ratio         ||s - s_before|| / ||s_before|| over the step (0 for a skipped step)

Activations (activation_stats), from one eager forward of a fixed batch without gradients, through
forward hooks (the blocks run their own forward meanwhile: parallel.wrap.eager_blocks):
    resid_rms, resid_mid_rms   RMS of the residual stream entering block i, and after its attention
    <norm>.<branch>/rms        RMS of a pre-norm's output per branch (s * N(x)): attn_norm, ffn_norm
    <map>/out_rms              RMS after a map's output normalization (QK-norm, DNP, post-norm; the
                               dense FFN's gate and up too; in an MoE layer the norm of down's
                               combined output, ffn/out_rms, and none of the norms inside the
                               experts)
    attn/max_logit             the largest attention logit q.k / sqrt(head_dim) a query gives a key
                               it attends (causal, or within its document), after RoPE
and diag/final/resid_rms, diag/final_norm.final/rms before the head.

Outliers (map_input_stats), per block map, of its input as its matmul gets it (after its input
site), in the same kind of forward:
    in_kurtosis                E[(x - mean)^4] / var^2 over the input's values (3 for a Gaussian)
    in_max_rms                 max |x| / RMS(x)
    fp8_underflow              under model.fp8, on a converted map: the share of the input's nonzero
                               values its FP8 cast (the recipe's scales) flushes to 0
    fp8_saturated              ... and the share cast to the FP8 format's largest magnitude
and (fp8_grad_snr) per converted map, from one forward and backward of the batch's loss with FP8 and
one with every map on F.linear (bf16 under autocast):
    fp8_grad_snr_db            10 log10(||g_bf16||^2 / ||g_fp8 - g_bf16||^2) of the weight's
                               gradient, at most 120 (equal gradients); not measured where FSDP
                               all-gathers the weights in FP8 (they hold no bf16 copy to recompute
                               with)
"""

import math
from contextlib import nullcontext

import torch
from torch import nn

from scalevec_train.model.layers import Linear, map_output
from scalevec_train.model.masking import dense_mask
from scalevec_train.model.strategies import scale_sites, site_display_name
from scalevec_train.model.transformer import FeedForward
from scalevec_train.parallel.data_parallel import reshard
from scalevec_train.parallel.fp8 import Fp8Matmul, bf16_matmuls, gathered_in_fp8
from scalevec_train.parallel.process_group import full_value
from scalevec_train.parallel.wrap import eager_blocks
from scalevec_train.training.trainer import cross_entropy


def _key(path: str) -> str:
    """diag/layer<i>/<rest of path> or diag/<path> for a module path of the model."""
    layer, name = site_display_name(path)
    return f"diag/{name}" if layer is None else f"diag/layer{layer}/{name}"


def linear_maps(model: nn.Module) -> dict[str, torch.Tensor]:
    """{key prefix: weight} of every linear map: each matrix and expert stack but an untied
    embedding (a lookup), and the output head (the embedding itself when tied) as diag/head."""
    tied = getattr(model, "head", None) is None
    maps = {}
    for name, p in model.named_parameters():
        if p.dim() < 2 or (name == "tok_emb.weight" and not tied):
            continue
        path = name.removesuffix(".weight")
        maps["diag/head" if path in ("head", "tok_emb") else _key(path)] = p
    return maps


def input_scales(model: nn.Module) -> dict[int, torch.Tensor]:
    """{id(weight): g}: the product of the learnable sites on each map's input side; maps without
    one are absent."""
    scales: dict[int, torch.Tensor] = {}
    for entry in model.site_maps():
        s = entry.site() if entry.side == "in" else None
        if s is None:
            continue
        for m in entry.maps:
            g = scales.get(id(m.weight))
            scales[id(m.weight)] = s.detach().float() if g is None else g * s.detach().float()
    return scales


@torch.no_grad()
def weights_before(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the maps' weights (this rank's shards) for the update ratio of the coming step."""
    reshard(model)
    return {key: w.detach().clone() for key, w in linear_maps(model).items()}


def scale_vectors(model: nn.Module) -> dict[str, torch.Tensor]:
    """{key prefix: s} of every learnable scale site (a fixed one has no vector)."""
    return {_key(path): s.detach().float() for path, site in scale_sites(model)
            if (s := site()) is not None}


@torch.no_grad()
def sites_before(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the sites' vectors for the update ratio of the coming step."""
    return {key: s.clone() for key, s in scale_vectors(model).items()}


@torch.no_grad()
def site_stats(model: nn.Module,
               before: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The statistics of every scale site's vector (module docstring); scale_update_ratio against
    `before` (sites_before() of the step) where given."""
    out = {}
    for key, s in scale_vectors(model).items():
        s = full_value(s)
        out[f"{key}/scale_rms"], out[f"{key}/scale_mean"] = _rms(s), s.mean()
        if before is not None:
            old = full_value(before[key])
            out[f"{key}/scale_update_ratio"] = (s - old).norm() / old.norm()
    return out


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().square().mean().sqrt()


def _cv(x: torch.Tensor) -> torch.Tensor:
    return x.std(correction=0) / x.mean()


def _corr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a - a.mean(), b - b.mean()
    denom = (a.square().sum() * b.square().sum()).sqrt()
    return torch.where(denom > 0, (a * b).sum() / denom, torch.zeros_like(denom))


@torch.no_grad()
def map_stats(model: nn.Module,
              before: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The weight statistics of every linear map (module docstring); update_ratio against `before`
    (weights_before() of the step) where given. A collective under FSDP: every rank calls it. Of the
    fp32 master weights, also where a forward (an evaluation) left the root's gathered."""
    reshard(model)
    scales, maps = input_scales(model), linear_maps(model)
    out = {}
    for key, param in maps.items():
        w = param.detach().float()
        col_sq = full_value(w.square().sum(-2))  # [in] or [experts, in]
        c = col_sq.sqrt().flatten()
        stats = {"weight_rms": (col_sq.sum() / w.numel()).sqrt(), "col_rms": _rms(c),
                 "col_cv": _cv(c)}
        if before is not None:
            old = before[key].float()
            stats["update_ratio"] = (full_value((w - old).square().sum())
                                     / full_value(old.square().sum())).sqrt()
        g = scales.get(id(param))
        if g is not None:
            g = g.abs().expand(col_sq.shape).flatten()
            e = g * c
            stats.update(eff_col_rms=_rms(e), eff_col_cv=_cv(e),
                         col_gain=_rms(e) / stats["col_rms"], g_col_corr=_corr(g, c))
        out.update({f"{key}/{k}": v for k, v in stats.items()})
    return out


class _Probe:
    """The forward hooks of activation_stats: they put their values in `out`."""

    def __init__(self, model: nn.Module, doc_ids: torch.Tensor | None):
        self.out: dict[str, torch.Tensor] = {}
        self.doc_ids = doc_ids
        self.handles = []
        self.qk: dict[str, torch.Tensor] = {}
        for i, block in enumerate(model.layers):
            prefix = f"diag/layer{i}"
            self._hook(block.attn_norm,
                       self._pre_norm(f"{prefix}/resid_rms", f"{prefix}/attn_norm"))
            self._hook(block.ffn_norm,
                       self._pre_norm(f"{prefix}/resid_mid_rms", f"{prefix}/ffn_norm"))
            for name in ("wq", "wk", "wv", "wo"):
                self._hook(getattr(block.attn, name), self._linear(f"{prefix}/attn.{name}", name))
            self._hook(block.attn, self._attention(f"{prefix}/attn/max_logit"))
            ffn = block.ffn
            if isinstance(ffn, FeedForward):
                self._hook(ffn.w_down, self._linear(f"{prefix}/ffn.w_down", "w_down"))
                self.handles.append(ffn.register_forward_pre_hook(self._gate_up(prefix)))
            # MoE: down's combined output, normalized
            elif getattr(ffn, "out_norm", None) is not None:
                self._hook(ffn, lambda m, args, y, key=f"{prefix}/ffn/out_rms":
                           self.out.__setitem__(key, _rms(y)))
        self._hook(model.final_norm, self._pre_norm("diag/final/resid_rms", "diag/final_norm"))

    def _hook(self, module: nn.Module, fn) -> None:
        self.handles.append(module.register_forward_hook(fn))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _pre_norm(self, stream_key: str, prefix: str):
        def hook(module, args, output):
            branches, stream = output
            self.out[stream_key] = _rms(stream)
            for branch, value in branches.items():
                self.out[f"{prefix}.{branch}/rms"] = _rms(value)
        return hook

    def _linear(self, key: str, name: str):
        def hook(module: Linear, args, output):
            if name in ("wq", "wk"):
                self.qk[name] = output
            if module.out_norm is not None:
                self.out[f"{key}/out_rms"] = _rms(output)
        return hook

    def _gate_up(self, prefix: str):
        def hook(ffn: FeedForward, args):
            b = args[0]
            for lin, branch in ((ffn.w_gate, "gate"), (ffn.w_up, "up")):
                if lin.out_norm is not None:
                    y = lin.project(b.get(branch, b.get("ffn")))
                    self.out[f"{prefix}/ffn.w_{branch}/out_rms"] = _rms(
                        map_output(y, lin.out_site, lin.eps, lin.kernels))
        return hook

    def _attention(self, key: str):
        def hook(attn, args, output):
            _, rope, mask, positions = args
            batch, seq, _ = self.qk["wq"].shape
            q = rope(self.qk["wq"].view(batch, seq, attn.n_heads, -1).transpose(1, 2),
                     positions).float()
            k = rope(self.qk["wk"].view(batch, seq, attn.n_kv_heads, -1).transpose(1, 2),
                     positions).float()
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
            if mask is not None:
                allowed = dense_mask(self.doc_ids)[:, 0]
            group = attn.n_heads // attn.n_kv_heads
            best = []
            # one head at a time: [batch, seq, seq] scores, not all heads'
            for h in range(attn.n_heads):
                scores = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(attn.head_dim)
                best.append(scores.masked_fill(~allowed, -math.inf).amax())
            self.out[key] = torch.stack(best).max()
        return hook


@torch.no_grad()
def activation_stats(model: nn.Module, tokens: torch.Tensor, doc_ids: torch.Tensor | None,
                     autocast) -> dict[str, torch.Tensor]:
    """The activation statistics (module docstring) of one forward of `tokens` (and `doc_ids`, which
    the model uses as in training) under `autocast`, in eval mode; the model's parameters and
    buffers are left as they were (an MoE layer counts no tokens without gradients)."""
    probe = _Probe(model, doc_ids)
    was_training = model.training
    model.eval()
    try:
        with eager_blocks(model), autocast():
            model(tokens, doc_ids=doc_ids)
    finally:
        probe.remove()
        model.train(was_training)
    return probe.out


@torch.no_grad()
def map_input_stats(model: nn.Module, tokens: torch.Tensor, doc_ids: torch.Tensor | None,
                    autocast) -> dict[str, torch.Tensor]:
    """The outlier statistics (module docstring) of every block map's input in one forward of
    `tokens` under `autocast`, in eval mode."""
    out: dict[str, torch.Tensor] = {}
    maps = [(path, m) for path, m in model.named_modules() if isinstance(m, Linear)]
    own = {path: vars(m).get("matmul") for path, m in maps}  # FP8's, where the map is converted

    def measured(path: str, matmul):
        def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            v = x.detach().float()
            centered = v - v.mean()
            var = centered.square().mean()
            out[f"{_key(path)}/in_kurtosis"] = centered.pow(4).mean() / var.square()
            out[f"{_key(path)}/in_max_rms"] = v.abs().amax() / v.square().mean().sqrt()
            if isinstance(matmul, Fp8Matmul):
                (out[f"{_key(path)}/fp8_underflow"],
                 out[f"{_key(path)}/fp8_saturated"]) = matmul.cast_shares(x)
            return matmul(x, w)
        return call

    for path, m in maps:
        m.matmul = measured(path, m.matmul)
    was_training = model.training
    model.eval()
    try:
        with eager_blocks(model), autocast():
            model(tokens, doc_ids=doc_ids)
    finally:
        model.train(was_training)
        for path, m in maps:
            if own[path] is None:
                del m.matmul
            else:
                m.matmul = own[path]
    return out


def fp8_grad_snr(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                 doc_ids: torch.Tensor | None, autocast) -> dict[str, torch.Tensor]:
    """fp8_grad_snr_db of every converted map (module docstring), from the loss of one batch in eval
    mode (an MoE layer counts no tokens); the gradients are dropped after. A collective under FSDP
    (the backward's reduce-scatters): every rank calls it."""
    maps = {path: m for path, m in model.named_modules()
            if isinstance(m, Linear) and "matmul" in vars(m)}
    if not maps or gathered_in_fp8(model):
        return {}
    grads = []
    was_training = model.training
    model.eval()
    try:
        for matmuls in (nullcontext(), bf16_matmuls(model)):
            with matmuls, eager_blocks(model):
                with autocast():
                    loss = cross_entropy(model(tokens, doc_ids=doc_ids), targets)
                loss.backward()
            grads.append({path: m.weight.grad.detach() for path, m in maps.items()})
            model.zero_grad(set_to_none=True)
    finally:
        model.train(was_training)
    out = {}
    for path, g in grads[0].items():
        ref = grads[1][path].float()
        signal, noise = full_value(ref.square().sum()), full_value((g.float() - ref).square().sum())
        out[f"{_key(path)}/fp8_grad_snr_db"] = 10 * torch.log10(
            signal / noise.clamp_min(signal * 1e-12))
    return out

"""describe's report of a config: every scale site of a model under a strategy (the rows of its
scale plan: role, parameterization, shape, the optimizer's peak LR and decay, the maps it scales,
how it folds, a cancelled magnitude), every other parameter's init, LR, decay, Adam eps and forward
multiplier under model.parameterization (parameterization.py, optim/groups.py's `rates`), what it
costs in parameters and FLOPs, under model.fp8 every matrix's precision and why
(parallel/fp8.py decides), and the memory each rank needs. Builds the model on the meta device, so
any preset describes instantly.

Memory: per rank on `world_size` GPUs (the micro-batch derived for that many ranks) for the config's
optimizer and distributed.activation_checkpointing: parameters, gradients, optimizer state,
activations (kept by the forward, and one block's recompute under checkpointing), logits and loss,
FSDP's gathered blocks, the optimizer step's transients, and the total against a device of
`device_gb` GB (10^9 bytes), with the change that makes it fit when it does not and the world sizes
it fits on (memory.py documents each term); under distributed.expert_parallel, the bytes each rank
sends per step in the experts' all-to-alls (communication.py)."""


import copy
import json
from typing import get_args

import torch
from omegaconf import DictConfig, OmegaConf

from scalevec_train.config import to_config
from scalevec_train.costs.accounting import (
    active_params,
    non_embedding_params,
    norm_flops_per_token,
    total_params,
    train_flops_per_token,
)
from scalevec_train.costs.communication import expert_all_to_all
from scalevec_train.costs.memory import GB, estimate, fix, precision
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.config import ScaleConfig
from scalevec_train.model.parameterization import Kind
from scalevec_train.model.plan import ScalePlan
from scalevec_train.model.strategies import site_display_name
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import param_groups, rates
from scalevec_train.parallel.config import ActivationCheckpointing
from scalevec_train.parallel.fp8 import map_precisions

# the keys of a site in describe's JSON
JSON_SITE_KEYS = ("name", "role", "param", "shape", "behind_norm", "lr", "weight_decay", "decayed",
                  "magnitude_cancelled_by", "side", "maps", "folds")


def report(raw: DictConfig, world: int, device_gb: float) -> dict:
    """describe's report of a composed config: its sites and costs, and its memory on `world`
    ranks."""
    # the sites and their costs do not depend on the ranks: described as on one process
    d = describe(to_config(OmegaConf.merge(raw, {"distributed": {"expert_parallel": 1}})))
    d["memory"] = memory(raw, world, device_gb)
    return d


def as_json(d: dict) -> str:
    return json.dumps(dict(d, sites=[{k: s[k] for k in JSON_SITE_KEYS} for s in d["sites"]]))


def as_text(d: dict) -> str:
    precisions = [format_precisions(d)] if "fp8" in d else []
    return "\n\n".join([format_table(d), format_parameters(d), *precisions,
                        format_memory(d["memory"])])


def build_meta(model_cfg, scale_cfg) -> Transformer:
    with torch.device("meta"):
        return Transformer(model_cfg, scale_cfg)


def describe(cfg, attended: float | None = None) -> dict:
    """attended: under model.attention_mask=document, the mean keys a query attends on the run's
    data (TokenLoader.attended_keys); without it attention is counted at its causal bound,
    seq_len."""
    model = build_meta(cfg.model, cfg.scale)
    total = total_params(model)
    # each site's LR and decay as the optimizer gets them (optim/groups.py), not decided again here
    by_id = {id(p): g for g in param_groups(model, cfg.optim) for p in g["params"]}
    group_of = {n: by_id[id(p)] for n, p in model.named_parameters()}
    sites = []
    for row in model.plan.rows:
        layer, name = site_display_name(row.path)
        own = {p.name: group_of[f"{row.path}.{p.name}"] for p in row.params}
        decay = {n: g.get("log_weight_decay", g["weight_decay"]) for n, g in own.items()}
        decayed = [n for n, wd in decay.items() if wd]
        sites.append({
            "name": row.path, "layer": layer, "site": name, "role": row.role, "param": row.param,
            "shape": list(row.shape), "behind_norm": row.behind_norm, "params": row.numel,
            # peak LR (None: a fixed site, no parameter); the decay and the parameters it acts on
            "lr": next((g["base_lr"] for g in own.values()), None),
            "weight_decay": max(decay.values(), default=0.0), "decayed": decayed,
            "magnitude_cancelled_by": row.cancelled_by,
            # the maps it scales (their inputs or outputs), and what folding does with it
            "side": row.side, "maps": list(dict.fromkeys(m.name for m in row.maps)),
            "folds": row.fold,
        })
    scale_params = sum(s["params"] for s in sites)
    parameters = _parameters(model, cfg.optim, group_of)
    baseline = ScalePlan.build(cfg.model, ScaleConfig(name="baseline"))
    extra = 3 * (norm_flops_per_token(model.plan) - norm_flops_per_token(baseline))
    documents = cfg.model.attention_mask == "document"
    model_flops = train_flops_per_token(model, cfg.train.seq_len, attended if documents else None)
    out = {
        "model": cfg.model.name, "scale": cfg.scale.name, "n_layers": cfg.model.n_layers,
        "total_params": total, "non_embedding_params": non_embedding_params(model),
        "scale_params": scale_params, "scale_share": scale_params / total,
        "extra_train_flops_per_token": extra, "extra_flops_share": extra / model_flops,
        "train_flops_per_token": model_flops, "sites": sites,
        "parameterization": _multipliers(model), "parameters": parameters,
    }
    if cfg.model.moe is not None:
        out["active_params"] = active_params(model)
    if cfg.model.fp8 != "none":
        out["fp8"] = {"recipe": cfg.model.fp8, "filter": cfg.model.fp8_filter,
                      "maps": _precisions(model, cfg)}
    if documents:
        out["attention_mask"] = "document"
        out["attended_keys"] = attended  # None: not measured, attention counted at seq_len
    return out


def _multipliers(model: Transformer) -> dict:
    p = model.parameterization
    return {"name": p.name, "width_multiplier": p.width, "depth_multiplier": p.depth,
            "logits": p.readout, "router_logits": p.readout, "residual_branches": p.residual,
            "attention_scale": p.attention_scale if p.attention_scale is not None
            else p.head_dim**-0.5}


def _parameters(model: Transformer, optim, group_of: dict) -> list[dict]:
    """Every parameter but the scale sites' (their table above): its muP kind, init std, peak LR and
    the multiplier the parameterization puts on it, decoupled weight decay, Adam eps and forward
    multiplier."""
    p = model.parameterization
    sites = model.plan.site_parameters()
    rows = []
    for name, param in model.named_parameters():
        kind = p.kind(name, sites)
        if kind is Kind.VECTOR:
            continue
        g = group_of[name]
        muon = bool(g.get("use_muon"))
        r = rates(p, kind, optim, muon)
        rows.append({"name": name, "kind": kind, "shape": list(param.shape),
                     "init_std": p.init(name, kind),
                     "lr": g["base_lr"], "lr_multiplier": r.lr, "weight_decay": g["weight_decay"],
                     "eps": None if muon else g.get("eps", optim.eps),
                     "forward_multiplier": p.forward_multiplier(name, kind), "optimizer": "muon"
                     if muon else "adamw"})
    return rows


def _precisions(model: Transformer, cfg) -> list[dict]:
    """Every matrix's matmul precision under model.fp8: the recipe where it converts, else
    train.dtype's compute dtype on a GPU (the routers' fp32)."""
    other = "bf16" if cfg.train.dtype in ("auto", "bf16") else "fp32"
    return [{"name": r.name, "shape": list(r.shape), "fp8": r.fp8, "why": r.why,
             "precision": f"fp8 {cfg.model.fp8}" if r.fp8 else "fp32" if ".router." in r.name
             else other}
            for r in map_precisions(model)]


def format_precisions(d: dict) -> str:
    """The matrices' precisions under model.fp8, one row per name with every layer's index
    as * where the layers agree (a layer that differs gets rows of its own)."""
    f = d["fp8"]
    rows: dict[tuple, list[int | None]] = {}
    for m in f["maps"]:
        parts = m["name"].split(".")
        layer = int(parts[1]) if parts[0] == "layers" else None
        name = ".".join(["layers", "*", *parts[2:]]) if layer is not None else m["name"]
        rows.setdefault((name, "x".join(map(str, m["shape"])), m["precision"], m["why"]),
                        []).append(layer)
    converted = sum(m["fp8"] for m in f["maps"])
    lines = [f"model.fp8={f['recipe']}, model.fp8_filter={f['filter']}: {converted} of "
             f"{len(f['maps'])} matrices in FP8 (MFU stays against the bf16 peak)",
             f"{'matrix':<34} {'layers':<8} {'shape':<14} {'precision':<24} why"]
    for (name, shape, runs_in, why), layers in rows.items():
        where = ("-" if layers == [None] else "all" if len(layers) == d["n_layers"]
                 else ",".join(map(str, layers)))
        lines.append(f"{name:<34} {where:<8} {shape:<14} {runs_in:<24} {why}")
    return "\n".join(lines)


def format_parameters(d: dict) -> str:
    """The parameters' table, one row per name with every layer's index as *."""
    m = d["parameterization"]
    lines = [f"parameterization {m['name']}: width x{m['width_multiplier']:g}, depth "
             f"x{m['depth_multiplier']:g}; logits x{m['logits']:g}, residual branches "
             f"x{m['residual_branches']:g}, attention scale {m['attention_scale']:.4g}",
             f"{'parameter':<34} {'kind':<9} {'init std':>9} {'lr':>9} {'lr mult':>8} {'decay':>7} "
             f"{'eps':>9} {'forward':>8} optimizer"]
    seen = set()
    for r in d["parameters"]:
        parts = r["name"].split(".")
        name = ".".join(["layers", "*", *parts[2:]]) if parts[0] == "layers" else r["name"]
        if name in seen:
            continue
        seen.add(name)
        eps = "-" if r["eps"] is None else f"{r['eps']:.3g}"
        lines.append(f"{name:<34} {r['kind']:<9} {r['init_std']:>9.4g} {r['lr']:>9.4g} "
                     f"{r['lr_multiplier']:>8.4g} {r['weight_decay']:>7.4g} {eps:>9} "
                     f"{r['forward_multiplier']:>8.4g} {r['optimizer']}")
    return "\n".join(lines)


def format_table(d: dict) -> str:
    lines = [f"{'layer':>5}  {'site':<28} {'role':<6} {'param':<5} {'shape':<12} {'lr':<8} "
             f"{'decay':<16} {'params':>8}  {'scales':<20} {'folds':<7} notes"]
    for s in d["sites"]:
        layer = "-" if s["layer"] is None else str(s["layer"])
        shape = "x".join(map(str, s["shape"]))
        site = s["site"] + (" (norm)" if s["behind_norm"] else "")
        lr = "-" if s["lr"] is None else f"{s['lr']:g}"
        decay = f"{s['weight_decay']:g} on {'+'.join(s['decayed'])}" if s["decayed"] else "no"
        scales = f"{s['side']}: {','.join(s['maps'])}" if s["maps"] else "-"
        notes = (f"magnitude cancelled by {s['magnitude_cancelled_by']}"
                 if s["magnitude_cancelled_by"] else "")
        lines.append(f"{layer:>5}  {site:<28} {s['role']:<6} {s['param']:<5} {shape:<12} {lr:<8} "
                     f"{decay:<16} {s['params']:>8,}  {scales:<20} "
                     f"{s['folds']:<7} {notes}".rstrip())
    lines.append("")
    lines.append(f"model {d['model']}, scale {d['scale']}: {d['total_params']:,} parameters"
                 + (f" ({d['active_params']:,} active per token)" if "active_params" in d else ""))
    lines.append(f"scale parameters: {d['scale_params']:,} "
                 f"({100 * d['scale_share']:.4f}% of the model)")
    lines.append("extra training FLOPs per token against baseline: "
                 f"{d['extra_train_flops_per_token']:,} ({100 * d['extra_flops_share']:.4f}% of "
                 f"{d['train_flops_per_token']:,.0f})")
    if d.get("attention_mask") == "document":
        lines.append("attention within documents: " + (
            f"{d['attended_keys']:,.1f} keys per query on the data"
            if d["attended_keys"] is not None else
            "counted at seq_len, its causal bound (the run measures it on the "
            "data: describe.json)"))
    return "\n".join(lines)


# The world sizes the memory report checks (the micro-batch is derived for each).
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def memory(raw: DictConfig, world: int, device_gb: float) -> dict:
    """The per-rank memory of the composed config on `world` GPUs against `device_gb`, the fix when
    it does not fit, and the world sizes (of WORLD_SIZES, where the global batch splits) it fits
    on."""
    device = device_gb * GB
    try:
        at_world = to_config(raw, world)
    except ScalevecError as e:  # describe still reports the sites
        return {"world_size": world, "error": str(e)}
    est = estimate(at_world, world)
    all_to_all = expert_all_to_all(at_world, build_meta(at_world.model, at_world.scale), world,
                                   precision(at_world, "cuda", world).compute)
    fits_on = []
    for w in WORLD_SIZES:
        try:
            if estimate(to_config(raw, w), w).total <= device:
                fits_on.append(w)
        except ScalevecError:  # the global batch does not split over w ranks
            continue
    by_mode = {}
    for mode in get_args(ActivationCheckpointing):
        trial = copy.deepcopy(at_world)
        trial.distributed.activation_checkpointing = mode
        e = estimate(trial, world)
        by_mode[mode] = {"activations": e.activations, "recompute": e.recompute, "total": e.total}
    return dict(est.as_dict(), device_bytes=device, fits=est.total <= device,
                fix=fix(at_world, world, device),
                fits_world_sizes=fits_on, by_checkpointing=by_mode,
                expert_parallel=at_world.distributed.expert_parallel,
                all_to_all_bytes_per_step=None if all_to_all is None else all_to_all.total)


def format_memory(m: dict) -> str:
    if "error" in m:
        return f"memory per rank on {m['world_size']} GPU(s): not estimated: {m['error']}"
    rows = ["params", "grads", "accumulated_grads", "optimizer", "skip_copies", "ema",
            "activations", "recompute",
            "logits", "fsdp_buffers", "optimizer_step", "overhead", "total"]
    lines = [f"memory per rank on {m['world_size']} GPU(s) (sharded over {m['shard_size']}), "
             f"micro-batch of {m['micro_batch_tokens']:,} tokens x {m['accumulation']}, activation "
             f"checkpointing {m['activation_checkpointing']}:"]
    lines += [f"  {k:<18} {m[k] / GB:8.2f} GB" for k in rows]
    modes = ", ".join(f"{mode} {(e['activations'] + e['recompute']) / GB:.2f} GB (total "
                      f"{e['total'] / GB:.1f})"
                      for mode, e in m["by_checkpointing"].items())
    lines.append(f"  activations (+ recompute) by checkpointing mode: {modes}")
    verdict = "fits" if m["fits"] else f"does not fit; fix: {m['fix']}"
    lines.append(f"  {m['total'] / GB:.1f} of {m['device_bytes'] / GB:.0f} GB: {verdict}")
    sizes = ", ".join(map(str, m["fits_world_sizes"])) or "none"
    lines.append(f"  fits {m['device_bytes'] / GB:.0f} GB on world sizes: {sizes}")
    if m["all_to_all_bytes_per_step"] is not None:
        lines.append(f"  expert parallelism over {m['expert_parallel']} ranks: each rank sends "
                     f"{m['all_to_all_bytes_per_step'] / GB:.3f} GB per step in the experts' "
                     "all-to-alls (balanced routing)")
    return "\n".join(lines)



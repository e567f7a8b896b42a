"""`python -m scalevec_train.describe model=<preset> scale=<preset> [format=json]`: every scale site of a
model under a strategy, what it costs in parameters and FLOPs. Builds the model on the meta device,
so any preset describes instantly."""

import json
import sys

import torch
from hydra.errors import HydraException

from scalevec_train.accounting import (
    active_params,
    non_embedding_params,
    norm_flops_per_token,
    total_params,
    train_flops_per_token,
)
from scalevec_train.config import compose_config
from scalevec_train.errors import ScalevecError
from scalevec_train.model.config import ScaleConfig
from scalevec_train.model.strategies import scale_sites, site_display_name
from scalevec_train.model.transformer import Transformer


def build_meta(model_cfg, scale_cfg) -> Transformer:
    with torch.device("meta"):
        return Transformer(model_cfg, scale_cfg)


def describe(cfg) -> dict:
    model = build_meta(cfg.model, cfg.scale)
    baseline = build_meta(cfg.model, ScaleConfig(name="baseline"))
    total = total_params(model)
    cancelled = {id(m.site): m.cancelled_by for m in model.site_maps()}
    sites = []
    for path, site in scale_sites(model):
        layer, name = site_display_name(path)
        sites.append({
            "name": path, "layer": layer, "site": name, "role": site.role, "param": site.param,
            "shape": list(site.shape), "behind_norm": site.behind_norm,
            "params": sum(p.numel() for p in site.parameters()),
            "weight_decay": cfg.scale.decays(site),
            "magnitude_cancelled_by": cancelled[id(site)],
        })
    scale_params = sum(s["params"] for s in sites)
    extra = 3 * (norm_flops_per_token(model) - norm_flops_per_token(baseline))
    model_flops = train_flops_per_token(model, cfg.train.seq_len)
    out = {
        "model": cfg.model.name, "scale": cfg.scale.name, "total_params": total,
        "non_embedding_params": non_embedding_params(model),
        "scale_params": scale_params, "scale_share": scale_params / total,
        "extra_train_flops_per_token": extra, "extra_flops_share": extra / model_flops,
        "train_flops_per_token": model_flops, "sites": sites,
    }
    if cfg.model.moe is not None:
        out["active_params"] = active_params(model)
    return out


def format_table(d: dict) -> str:
    lines = [f"{'layer':>5}  {'site':<28} {'role':<6} {'param':<5} {'shape':<12} {'decay':<5} {'params':>8}  notes"]
    for s in d["sites"]:
        layer = "-" if s["layer"] is None else str(s["layer"])
        shape = "x".join(map(str, s["shape"]))
        site = s["site"] + (" (norm)" if s["behind_norm"] else "")
        notes = f"magnitude cancelled by {s['magnitude_cancelled_by']}" if s["magnitude_cancelled_by"] else ""
        lines.append(f"{layer:>5}  {site:<28} {s['role']:<6} {s['param']:<5} {shape:<12} "
                     f"{'yes' if s['weight_decay'] else 'no':<5} {s['params']:>8,}  {notes}".rstrip())
    lines.append("")
    lines.append(f"model {d['model']}, scale {d['scale']}: {d['total_params']:,} parameters"
                 + (f" ({d['active_params']:,} active per token)" if "active_params" in d else ""))
    lines.append(f"scale parameters: {d['scale_params']:,} ({100 * d['scale_share']:.4f}% of the model)")
    lines.append(f"extra training FLOPs per token against baseline: {d['extra_train_flops_per_token']:,} "
                 f"({100 * d['extra_flops_share']:.4f}% of {d['train_flops_per_token']:,.0f})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    fmt = "table"
    overrides = []
    for arg in argv:
        if arg.startswith("format="):
            fmt = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    try:
        if fmt not in ("table", "json"):
            raise ScalevecError("format", f"unknown format {fmt!r}.", "use format=table or format=json.")
        cfg = compose_config(overrides)
        d = describe(cfg)
    except (ScalevecError, HydraException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if fmt == "json":
        d = dict(d, sites=[{k: s[k] for k in ("name", "role", "param", "shape", "behind_norm", "weight_decay",
                                              "magnitude_cancelled_by")} for s in d["sites"]])
        print(json.dumps(d))
    else:
        print(format_table(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

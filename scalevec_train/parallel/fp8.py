"""FP8 training of the block maps (model.fp8) through torchao's float8: the one module that uses
torchao, and imports it only when model.fp8 is not none.

- Which maps convert (map_precisions, also what describe lists): the block maps q, k, v, o, gate,
  up, down that model.fp8_keep does not name, whose dims divide by 16 (the FP8 matmul's requirement)
  and, under model.fp8_filter=auto, that torchao's size filter for the recipe keeps (rowwise's for
  rowwise_with_gw_hp, which torchao's filter does not take). Never the embedding, the head (tied or
  not), the routers (fp32), the MoE experts (torchao's FP8 grouped matmul is a prototype of CUDA
  Triton kernels that wants each expert's rows in multiples of 16, which dropless routing does not
  give) or a scale site (fp32: the sites are not matrices).
- The matmul (convert): the maps are not nn.Linear, so torchao's module swap finds none of them;
  each converted map's Linear.matmul becomes torchao's float8 matmul (the autograd function its
  Float8Linear calls) with the recipe's config, emulated off CUDA. Parameters, their names and
  dtypes stay as they are: a checkpoint resumes with or without FP8, and exports the same weights.
- Under FSDP2 on NCCL with tensorwise, each converted weight is torchao's
  WeightWithDynamicFloat8CastTensor, which FSDP all-gathers in FP8 (gloo has no FP8 collectives),
  and precompute_scales, after every optimizer step, computes the scales of all of them in one
  all-reduce.
"""

import logging
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.layers import Linear
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.process_group import is_main

# a weight of its own, but no map of a block's attention or feed-forward
_NOT_A_BLOCK_MAP = (
    ("tok_emb.weight", "the embedding: a lookup (and the tied head's weight)"),
    ("head.weight", "the output head: its logits feed the loss"),
    (".router.weight", "the router: scores in fp32"),
    (".experts.w_",
     "an expert stack: torchao's FP8 grouped matmul runs on CUDA only, in row groups of 16"),
    (".shared.w_", "the shared expert: kept as the routed experts are"),
)


@dataclass(frozen=True)
class MapPrecision:
    """One matrix of the model and the precision its matmul runs in under model.fp8."""

    name: str  # the weight's parameter name
    shape: tuple[int, ...]  # [out, in]; an expert stack [experts, out, in]
    fp8: bool
    why: str


def map_precisions(model: Transformer) -> list[MapPrecision]:
    """Every matrix of `model` (on any device, the meta one too) in parameter order, whether
    model.fp8 converts its matmul, and why."""
    cfg = model.cfg
    keep = _size_filter(cfg.fp8) if cfg.fp8 != "none" and cfg.fp8_filter == "auto" else None
    maps = {f"{path}.weight": m for path, m in model.named_modules() if isinstance(m, Linear)}
    rows = []
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        shape = tuple(p.shape)
        if name not in maps:
            why = next(why for part, why in _NOT_A_BLOCK_MAP if part in name)
            rows.append(MapPrecision(name, shape, False, why))
            continue
        out, inner = shape
        kind = maps[name].map_name
        if cfg.fp8 == "none":
            fp8, why = False, "model.fp8=none"
        elif kind in cfg.fp8_keep:
            fp8, why = False, f"model.fp8_keep names {kind}"
        elif out % 16 or inner % 16:
            fp8, why = False, (f"{out}x{inner}: a dim not divisible by 16, "
                               "which the FP8 matmul needs")
        elif keep is None:
            fp8, why = True, "model.fp8_filter=all"
        elif keep(nn.Linear(inner, out, bias=False, device="meta"), name):
            fp8, why = True, f"above torchao's size thresholds for {_filter_recipe(cfg.fp8)}"
        else:
            fp8, why = False, (f"below torchao's size thresholds for {_filter_recipe(cfg.fp8)}, "
                               "where FP8 was slower than bf16 (model.fp8_filter=all converts it)")
        rows.append(MapPrecision(name, shape, fp8, why))
    return rows


def convert(model: Transformer, device: torch.device, all_gather: bool) -> None:
    """Put the FP8 matmul of model.fp8's recipe behind every map map_precisions converts (before the
    model is sharded; nothing for model.fp8=none). `all_gather`: FSDP will all-gather the converted
    weights in FP8 (tensorwise only)."""
    recipe = model.cfg.fp8
    if recipe == "none":
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ScalevecError("model.fp8", f"{torch.cuda.get_device_name(device)} has no FP8 matmul "
                            "(it needs compute capability 8.9 or newer: Ada, Hopper, Blackwell).",
                            "use model.fp8=none.")
    matmul = fp8_matmul(recipe, device, all_gather)
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    rows = map_precisions(model)
    if not any(r.fp8 for r in rows) and is_main():
        print(f"note: model.fp8={recipe} converts none of {model.cfg.name}'s maps under "
              f"model.fp8_filter={model.cfg.fp8_filter}, so it trains as without FP8; "
              "`python -m scalevec_train.describe` lists each map and why (model.fp8_filter=all "
              "converts every map whose dims divide by 16).", file=sys.stderr)
    for row in rows:
        if not row.fp8:
            continue
        linear = model.get_submodule(row.name.removesuffix(".weight"))
        linear.matmul = matmul
        if all_gather:
            w = linear.weight
            linear.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(
                w, matmul.mm_config, matmul.config.cast_config_weight.target_dtype),
                requires_grad=w.requires_grad)


def fp8_matmul(recipe: str, device: torch.device, all_gather: bool = False) -> "Fp8Matmul":
    """The FP8 matmul of torchao's recipe `recipe` on `device` (emulated off CUDA)."""
    float8 = _float8()
    from torchao.float8.float8_linear import Float8Linear

    config = replace(float8.Float8LinearConfig.from_recipe_name(recipe),
                     emulate=device.type != "cuda", enable_fsdp_float8_all_gather=all_gather)
    # the matmul configs as torchao's Float8Linear derives them from the recipe
    # (its shape does not enter)
    mm_config = Float8Linear(16, 16, bias=False, config=config, device="meta").linear_mm_config
    return Fp8Matmul(config, mm_config)


class Fp8Matmul:
    """x W^T as F.linear computes it, through torchao's float8 matmul: under autocast x and W in the
    autocast dtype first (the bf16 weights FSDP hands the forward too: one regime on one process and
    on many), then each operand cast to float8 with the recipe's scales. The product runs outside
    autocast, so that an emulated one stays fp32 before its output is rounded, as the GPU's scaled
    matmul does."""

    def __init__(self, config, mm_config):
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        self.config, self.mm_config = config, mm_config
        self._apply, self._is_fp8 = (matmul_with_hp_or_float8_args.apply,
                                     tensor_already_casted_to_fp8)

    @torch.no_grad()
    def cast_shares(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(underflow, saturated) of x cast as this matmul casts its input
        (with the recipe's scales): the share of x's nonzero values the cast flushes to 0, and the
        share at the format's largest magnitude."""
        from torchao.float8.float8_scaling_utils import (
            get_maybe_axiswise_dim,
            hp_tensor_to_float8_dynamic,
        )
        from torchao.float8.float8_training_tensor import GemmInputRole

        cast = self.config.cast_config_input
        fp8 = hp_tensor_to_float8_dynamic(
            x, cast.target_dtype, self.mm_config, gemm_input_role=GemmInputRole.INPUT,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(-1, cast.scaling_granularity),
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)._data.float()
        nonzero = x != 0
        underflow = ((fp8 == 0) & nonzero).sum() / nonzero.sum().clamp_min(1)
        return underflow, (fp8.abs() == torch.finfo(cast.target_dtype).max).float().mean()

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x = x.to(dtype)
            if w.dtype != dtype and not self._is_fp8(w):
                w = w.to(dtype)
        with torch.autocast(device, enabled=False):
            return self._apply(x, w.t(), self.mm_config, self.config)


@contextmanager
def bf16_matmuls(model: nn.Module) -> Iterator[None]:
    """Within the context every map computes with F.linear (the class's matmul shows through): the
    reference the diagnostics measure FP8's gradients against."""
    converted = [(m, vars(m)["matmul"]) for m in model.modules()
                 if isinstance(m, Linear) and "matmul" in vars(m)]
    for m, _ in converted:
        del m.matmul
    try:
        yield
    finally:
        for m, matmul in converted:
            m.matmul = matmul


def gathered_in_fp8(model: nn.Module) -> list[nn.Parameter]:
    """The weights FSDP all-gathers in FP8 (convert's all_gather; none unless
    model.fp8=tensorwise)."""
    if model.cfg.fp8 != "tensorwise":
        return []
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [p for p in model.parameters()
            if isinstance(p, DTensor)
            and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)]


@torch.no_grad()
def precompute_scales(weights: list[nn.Parameter]) -> None:
    """The FP8 scales of `weights` (gathered_in_fp8's) for the next all-gather, from their amaxes in
    one all-reduce: torchao's precompute_float8_dynamic_scale_for_fsdp, which finds weights only in
    its own Float8Linear modules. Every rank calls it, after each optimizer step."""
    from torchao.float8.float8_utils import EPS

    if not weights:
        return
    # the clamp all-reduces
    amax = torch.clamp(torch.stack(torch._foreach_norm(weights, ord=math.inf)), EPS)
    target = weights[0]._local_tensor._dtype
    # in float64, as torchao does, so that eager and compiled code agree
    scales = (torch.finfo(target).max / amax.to(torch.float64)).to_local().to(torch.float32)
    for w, scale in zip(weights, scales, strict=True):
        w._local_tensor._precomputed_scale = scale


def _filter_recipe(recipe: str) -> str:
    """The recipe whose size filter decides model.fp8_filter=auto (torchao has none for
    rowwise_with_gw_hp, whose matmuls run on rowwise's kernels)."""
    return "rowwise" if recipe == "rowwise_with_gw_hp" else recipe


def _size_filter(recipe: str):
    return _float8()._auto_filter_for_recipe(_filter_recipe(recipe), filter_fqns=[])


def _float8():
    """torchao.float8, imported on first use. Quiet on a CPU build of torch, where torchao's import
    warns that its CUDA kernels do not load (float8 training does not use them)."""
    quiet = () if torch.cuda.is_available() else ("torchao", "torch.utils._pytree")
    loggers = [logging.getLogger(name) for name in quiet]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8
    except ModuleNotFoundError:
        raise ScalevecError("model.fp8", "needs torchao, which is not installed.",
                            "pip install torchao==0.18.0 (make setup installs it), "
                            "or use model.fp8=none.") from None
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
    return torchao.float8

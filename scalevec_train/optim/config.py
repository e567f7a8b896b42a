"""The optimization options: the optimizer (`optim.*`) and the learning-rate schedule
(`schedule.*`)."""

from dataclasses import dataclass, field
from typing import Literal

from scalevec_train.infra.errors import ScalevecError, check_choices, choice
from scalevec_train.optim.muon import LR_ADJUSTS, NS_COEFFICIENTS, NS_DTYPES, check_options


@dataclass
class OptimConfig:
    # adamw | muon (hidden matrices with Muon; embeddings, head and scale vectors with AdamW)
    name: str = choice("adamw", Literal["adamw", "muon"])
    # peak learning rate (the schedule multiplies it); under muon the AdamW groups' too unless
    # adamw_lr
    lr: float = 3e-3
    # AdamW's betas and eps (under muon: of its AdamW groups)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # decoupled weight decay for hidden matrices (and whatever the options below include),
    # multiplied by the unadjusted LR; scale vectors follow scale.weight_decay
    weight_decay: float = 0.1
    # decay the token embedding (and a tied head) too
    decay_embeddings: bool = False
    # decay an untied output head too
    decay_head: bool = True
    # muon only: momentum of the gradient average (an EMA, as torch.optim.Muon's)
    momentum: float = 0.95
    # muon only: orthogonalize the Nesterov look-ahead instead of the momentum itself
    nesterov: bool = True
    # muon only: Newton-Schulz iterations
    ns_steps: int = 5
    # muon only: quintic ((3.4445, -4.7750, 2.0315) every iteration) | polar_express (one optimal
    # polynomial per iteration, Amsel et al. 2025: closer to the exact polar factor in as many
    # steps)
    ns_coefficients: str = choice("quintic", Literal[NS_COEFFICIENTS])
    # muon only: dtype of the Newton-Schulz matmuls: bfloat16 | float32 | float16
    ns_dtype: str = choice("bfloat16", Literal[NS_DTYPES])
    # muon only: match_rms_adamw (update x 0.2 * sqrt(max(rows, cols)): reuse AdamW's LR and
    # decay) | original (update x sqrt(max(1, rows / cols)): Muon's own LR, about 0.02)
    lr_adjust: str = choice("match_rms_adamw", Literal[LR_ADJUSTS])
    # muon only: floor of the norm that scales a matrix into Newton-Schulz's range
    ns_eps: float = 1e-7
    # muon only: orthogonalize the MoE router's weight with Muon instead of AdamW
    muon_router: bool = False
    # muon only: the AdamW groups' peak LR; null: lr (right for match_rms_adamw, needed with
    # original)
    adamw_lr: float | None = None
    # peak LR of every scale-site parameter (scale, beta, b, alpha), under AdamW and in Muon's AdamW
    # groups; null: the other AdamW groups' (lr, or adamw_lr under muon). The schedule multiplies it
    # too
    scale_lr: float | None = None
    # weight decay of the scale-site parameters the strategy decays (scale.weight_decay,
    # scale.reparam_decay, scale.decay_final_norm); null: weight_decay
    scale_weight_decay: float | None = None

    def validate(self) -> None:
        check_choices(self, "optim.")
        # the checks Muon's groups share; the choices above are the rest of ADAMW_KEYS + MUON_KEYS
        check_options(vars(self), ("weight_decay", "betas", "eps", "momentum", "ns_steps",
                                   "ns_eps"),
                      lambda key: f"optim.{key}")
        for key in ("adamw_lr", "scale_lr"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ScalevecError(f"optim.{key}", f"{value} is not positive.",
                                    "use null or a positive LR.")
        if self.scale_weight_decay is not None and self.scale_weight_decay < 0:
            raise ScalevecError("optim.scale_weight_decay",
                                f"{self.scale_weight_decay} is negative.",
                                "use null (optim.weight_decay) or 0 or more.")
        if self.lr <= 0:
            raise ScalevecError("optim.lr", f"{self.lr} is not positive.",
                                "use a learning rate > 0.")
        peak = max(self.lr, self.adamw_lr or 0.0)
        if peak * self.weight_decay >= 1:
            raise ScalevecError("optim.weight_decay", "lr * weight_decay = "
                                f"{peak * self.weight_decay:g}: a decoupled decay step (1 - lr * "
                                "wd) would zero or flip the weights.",
                                "lower optim.weight_decay or the learning rate so that their "
                                "product is below 1.")
        product = self.scale_peak_lr() * self.scale_decay()
        if product >= 1:
            key = ("optim.scale_weight_decay" if self.scale_weight_decay is not None
                   else "optim.scale_lr")
            raise ScalevecError(key, f"the scale sites' lr * weight_decay = {product:g}: a decay "
                                "step (1 - lr * wd) would zero or flip their magnitudes.",
                                "lower optim.scale_weight_decay or optim.scale_lr so that their "
                                "product is below 1.")

    def adamw_peak_lr(self) -> float:
        """The peak LR of the AdamW groups but the scale sites': adamw_lr under muon when set, else
        lr."""
        return self.adamw_lr if self.name == "muon" and self.adamw_lr is not None else self.lr

    def scale_peak_lr(self) -> float:
        """The peak LR of every scale-site parameter."""
        return self.adamw_peak_lr() if self.scale_lr is None else self.scale_lr

    def scale_decay(self) -> float:
        """The weight decay of the scale-site parameters the strategy decays."""
        return self.weight_decay if self.scale_weight_decay is None else self.scale_weight_decay


@dataclass
class ScheduleConfig:
    # constant | cosine | wsd (warmup-stable-decay)
    name: str = choice("cosine", Literal["constant", "cosine", "wsd"])
    # linear warmup from 0 to the peak LR over this many steps
    warmup_steps: int = 20
    # cosine and wsd: the LR at the end, as a share of the peak (the wsd preset sets 0)
    min_lr_ratio: float = 0.1
    # wsd only: the share of all steps spent in the final decay
    decay_fraction: float = 0.2
    # wsd only: linear | cosine | 1-sqrt
    decay_shape: str = choice("1-sqrt", Literal["linear", "cosine", "1-sqrt"])

    def validate(self, total_steps: int) -> None:
        check_choices(self, "schedule.")
        if not 0 <= self.warmup_steps <= total_steps:
            raise ScalevecError("schedule.warmup_steps",
                                f"{self.warmup_steps} is outside [0, train.steps={total_steps}].",
                                "set a warmup no longer than the run.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ScalevecError("schedule.min_lr_ratio", f"{self.min_lr_ratio} is outside [0, 1].")
        if self.name == "wsd":
            if not 0.0 < self.decay_fraction <= 1.0:
                raise ScalevecError("schedule.decay_fraction", f"{self.decay_fraction} is "
                                    "outside (0, 1].")
            if self.warmup_steps > total_steps - round(self.decay_fraction * total_steps):
                raise ScalevecError("schedule.warmup_steps", "warmup overlaps the WSD decay phase.",
                                    "shorten the warmup or the decay_fraction.")

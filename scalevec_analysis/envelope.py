"""The compute at which a reference reaches a loss, read from its measured curves rather than a
fitted law.

A reference's curves on one rung of a ladder (its trunk and the WSD branches decayed from it: every
evaluation record of each, compute = training FLOPs per token x tokens) pool into one set of
(compute, loss) points. Their *lower envelope* is the running minimum of the loss as the compute
grows: the lowest loss the reference has measured at or below each compute. It is non-increasing;
between its points it is taken linear in log compute. The compute at which the reference reaches a
loss L is where that line first gets to L: the log-linear interpolation between the envelope's last
point above L and its first point at or below it. Where the envelope never gets to L, all that is
known is that the reference needs more than its largest compute; where its first point is already at
or below L, that it needs at most that point's compute. Records at zero tokens (the evaluation
before the first step) have no place on a log axis and are left out.

A *reading* is a multiplier, the reference's compute to reach a loss divided by the strategy's
compute, or a bound on it. Since the envelope is non-increasing, a strategy point lower than the
envelope at its own compute reads above 1, and one higher reads at most 1.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

EXACT, ABOVE, AT_MOST = "", ">", "<="


@dataclass(frozen=True)
class Reading:
    """A multiplier read off measured curves: `value` itself (bound EXACT), or a bound on it: ABOVE
    (the reference never reaches the loss within its curves: more than `value`), AT_MOST (it is
    already there at its first evaluation). NaN with bound "?": the readings it summarizes bound it
    from both sides."""

    value: float
    bound: str = EXACT

    def text(self, spec: str = ".3f") -> str:
        if self.bound == "?":
            return "bounded both ways"
        return f"{self.bound}{' ' if self.bound else ''}{format(self.value, spec)}"


def lower_envelope(curves: Iterable[tuple[np.ndarray, np.ndarray]]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(compute, loss) curves -> the envelope's points: every point of positive compute, by compute
    (the lower loss first at equal compute), the loss replaced by its running minimum."""
    compute = np.concatenate([np.asarray(c, dtype=np.float64) for c, _ in curves])
    loss = np.concatenate([np.asarray(v, dtype=np.float64) for _, v in curves])
    kept = compute > 0
    order = np.lexsort((loss[kept], compute[kept]))
    return compute[kept][order], np.minimum.accumulate(loss[kept][order])


def compute_to_reach(compute: np.ndarray, envelope: np.ndarray, target: float) -> tuple[float, str]:
    """The compute at which the envelope (`lower_envelope`'s points) first gets to `target`, EXACT;
    else (its largest compute, ABOVE) when it never does, or (its first compute, AT_MOST) when it
    starts there."""
    reached = np.flatnonzero(envelope <= target)
    if reached.size == 0:
        return float(compute[-1]), ABOVE
    j = int(reached[0])
    if j == 0:
        return float(compute[0]), AT_MOST
    # the last point above the target and the first at or below it; the envelope falls between them
    (c0, c1), (l0, l1) = compute[j - 1:j + 1], envelope[j - 1:j + 1]
    return float(math.exp(math.log(c0) + (l0 - target) / (l0 - l1)
                          * (math.log(c1) - math.log(c0)))), EXACT


def read_multiplier(curves: Sequence[tuple[np.ndarray, np.ndarray]], compute: float,
                    loss: float) -> Reading:
    """The multiplier of a strategy point (compute, loss) against the reference's curves on
    its rung."""
    reference, bound = compute_to_reach(*lower_envelope(curves), loss)
    return Reading(reference / compute, bound)


def geometric_mean(readings: Sequence[Reading]) -> Reading:
    """The geometric mean of the readings' values: exact when all are, else a bound in the direction
    of the bounds among them (ABOVE or AT_MOST), undetermined when they bound it from both sides."""
    value = float(np.exp(np.mean(np.log([r.value for r in readings]))))
    bounds = {r.bound for r in readings} - {EXACT}
    if len(bounds) > 1:
        return Reading(math.nan, "?")
    return Reading(value, bounds.pop() if bounds else EXACT)

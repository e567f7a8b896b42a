"""Each schedule's value at warmup end, decay start and decay end against its closed form."""

import math

import pytest

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.optim.config import ScheduleConfig
from scalevec_train.optim.schedules import lr_multiplier

TOTAL = 1000


def test_warmup_is_linear_and_ends_at_peak():
    for name in ("constant", "cosine", "wsd"):
        cfg = ScheduleConfig(name=name, warmup_steps=100, min_lr_ratio=0.1)
        assert lr_multiplier(cfg, 0, TOTAL) == pytest.approx(1 / 100)
        assert lr_multiplier(cfg, 49, TOTAL) == pytest.approx(50 / 100)
        assert lr_multiplier(cfg, 99, TOTAL) == pytest.approx(1.0)


def test_cosine_closed_form():
    cfg = ScheduleConfig(name="cosine", warmup_steps=100, min_lr_ratio=0.1)
    assert lr_multiplier(cfg, 100, TOTAL) == pytest.approx(1.0)
    mid = 100 + 450
    assert (lr_multiplier(cfg, mid, TOTAL)
            == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert lr_multiplier(cfg, TOTAL, TOTAL) == pytest.approx(0.1)


@pytest.mark.parametrize("shape,at_half", [
    ("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_wsd_closed_form(shape, at_half):
    cfg = ScheduleConfig(name="wsd", warmup_steps=100, min_lr_ratio=0.2, decay_fraction=0.2,
                         decay_shape=shape)
    decay_start = TOTAL - 200
    assert lr_multiplier(cfg, 100, TOTAL) == 1.0
    assert lr_multiplier(cfg, decay_start - 1, TOTAL) == 1.0
    assert lr_multiplier(cfg, decay_start, TOTAL) == pytest.approx(1.0)
    assert lr_multiplier(cfg, decay_start + 100, TOTAL) == pytest.approx(0.2 + 0.8 * at_half)
    assert lr_multiplier(cfg, TOTAL, TOTAL) == pytest.approx(0.2)


def test_constant_stays_at_peak():
    cfg = ScheduleConfig(name="constant", warmup_steps=10)
    assert {lr_multiplier(cfg, s, TOTAL) for s in range(10, TOTAL)} == {1.0}


def test_bad_schedule_options_are_named():
    with pytest.raises(ScalevecError, match="schedule.decay_shape"):
        ScheduleConfig(name="wsd", decay_shape="cubic").validate(TOTAL)
    with pytest.raises(ScalevecError, match="schedule.warmup_steps"):
        ScheduleConfig(name="cosine", warmup_steps=2000).validate(TOTAL)

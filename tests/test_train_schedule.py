"""LR schedules: warm-up, cosine and warmup-stable-decay shapes; the adaptive cool-down."""

import math

import pytest

from hydra_lm.train import AdaptiveLR, lr_at

KW = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_warmup_is_linear_up_to_the_peak(schedule):
    lrs = [lr_at(s, schedule=schedule, **KW) for s in range(10)]
    assert lrs == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_at(10, schedule=schedule, **KW) == pytest.approx(1.0)


def test_cosine_decays_monotonically_to_min_lr():
    lrs = [lr_at(s, schedule="cosine", **KW) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lrs[0] == 1.0  # the first step after warm-up at the peak, step 10 + 89 / 3 a third of the way
    assert lr_at(10 + 89 / 3, schedule="cosine", **KW) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 3)))
    assert lr_at(100, schedule="cosine", **KW) == pytest.approx(0.1)


@pytest.mark.parametrize("max_steps, warmup_steps", [(100, 10), (10, 2), (5, 1), (3, 0), (1000, 100)])
def test_the_last_step_runs_at_min_lr(max_steps, warmup_steps):
    """Steps are numbered from 0: the run's last, max_steps - 1, lands on min_lr (cosine and WSD alike)."""
    for schedule in ("cosine", "wsd"):
        kw = dict(lr=1.0, min_lr=0.1, warmup_steps=warmup_steps, max_steps=max_steps, schedule=schedule)
        assert lr_at(max_steps - 1, **kw) == pytest.approx(0.1), schedule
        assert lr_at(max_steps - 2, **kw) > 0.1 + 1e-9, schedule


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fraction():
    lrs = [lr_at(s, schedule="wsd", wsd_decay_pct=0.2, **KW) for s in range(100)]
    assert lrs[10:80] == pytest.approx([1.0] * 70)  # stable phase
    decay = lrs[80:]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(0.1)  # the last step runs at min_lr
    steps = [a - b for a, b in zip(decay, decay[1:])]
    assert max(steps) == pytest.approx(min(steps))  # linear


def test_no_warmup():
    assert lr_at(0, lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=10, schedule="cosine") == pytest.approx(1.0)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="schedule"):
        lr_at(20, schedule="linear", **KW)


def test_adaptive_lr_cools_down_after_a_spike_and_round_trips():
    a = AdaptiveLR(spike=2.0, factor=0.5, cooldown=10)
    for step in range(1, 6):
        assert not a.observe(step, 3.0)
    assert a.multiplier(6) == 1.0
    assert a.observe(6, 7.0)  # > 2 x EMA
    assert a.multiplier(7) == 0.5 and a.multiplier(15) == 0.5 and a.multiplier(16) == 1.0
    assert a.ema == pytest.approx(0.9 * 3.0 + 0.1 * 6.0)  # the spike enters capped at 2 x EMA
    b = AdaptiveLR(spike=2.0, factor=0.5, cooldown=10)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.observe(20, float("nan"))
    # a non-finite loss cools down as a spike does, counted as one
    assert b.multiplier(21) == 0.5 and b.multiplier(29) == 0.5 and b.multiplier(30) == 1.0 and b.spikes == a.spikes + 1

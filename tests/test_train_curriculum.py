"""MoD/MoR curriculum: switches at the planned steps, the loss gate, the short-run override,
state round trip, and the switches as a real run records them."""

import torch

from hydra_lm.cli import main
from hydra_lm.train import Curriculum, CurriculumPlan, TrainConfig
from hydra_lm.train.options import resolve
from support import TINY_RUN, records


class FakeModel:
    def __init__(self):
        self.calls = []

    def set_curriculum(self, mod_active, mor_active, mor_ramp=1.0):
        self.calls.append((mod_active, mor_active))


def run_plan(curriculum, steps, losses=None, log_every=1):
    model, states = FakeModel(), []
    for step in range(steps):
        curriculum.apply(step, model)
        states.append((curriculum.mod_active, curriculum.mor_active))
        curriculum.observe(torch.tensor(losses(step) if losses else 9.0))
        if (step + 1) % log_every == 0:
            curriculum.check_gate(step + 1)
    return states, model


def test_plan_from_percentages_and_short_run_override():
    default = CurriculumPlan.from_config(TrainConfig(max_steps=200))
    assert (default.mod_gate_step, default.mod_force_step, default.mor_step) == (0, 0, 0)  # routing from step 0
    phases = dict(mod_enable_pct=0.1, mod_force_enable_pct=0.15, mor_enable_pct=0.3)
    short = CurriculumPlan.from_config(TrainConfig(max_steps=200, **phases))
    assert (short.mod_gate_step, short.mod_force_step, short.mor_step) == (30, 30, 60)
    assert short.loss_gate is None  # short run: no gate by default; MoD on at the force step
    kept = CurriculumPlan.from_config(TrainConfig(max_steps=200, no_short_run_override=True, **phases))
    assert kept.loss_gate == 5.0 and kept.mod_gate_step == 20
    long = CurriculumPlan.from_config(TrainConfig(max_steps=5000, **phases))
    assert (long.mod_gate_step, long.mod_force_step, long.mor_step, long.loss_gate) == (500, 750, 1500, 5.0)
    off = CurriculumPlan.from_config(TrainConfig(max_steps=5000, mod_off=True, mor_off=True))
    assert off.mod_gate_step is None and off.mor_step is None
    dense = CurriculumPlan.from_config(TrainConfig(max_steps=5000), routable=(False, False))
    assert dense.mod_gate_step is None and dense.mor_step is None


def test_the_force_step_defaults_to_the_enable_step_and_a_short_run_switches_there():
    def plan(steps, **flags):
        cfg = resolve(TrainConfig(max_steps=steps, warmup_steps=1, **flags), "debug", False)  # the trainer's checks
        return CurriculumPlan.from_config(cfg)

    enable = plan(5000, mod_enable_pct=0.5)  # was refused: the force step defaulted to 0.0
    assert (enable.mod_gate_step, enable.mod_force_step, enable.loss_gate) == (2500, 2500, 5.0)
    assert plan(200, mod_enable_pct=0.5).describe().startswith("MoD on at step 100;")
    # --mod_force_enable_pct alone: MoD on there whatever the loss, so not at step 0 in a short run either
    assert plan(200, mod_force_enable_pct=0.5).describe().startswith("MoD on at step 100;")
    assert plan(5000, mod_force_enable_pct=0.5).describe().startswith(
        "MoD on from step 0 once CE EMA < 5, forced at step 2500;")
    # a saved config's explicit 0.0 keeps its meaning
    saved = plan(5000, mod_force_enable_pct=0.0)
    assert (saved.mod_gate_step, saved.mod_force_step) == (0, 0)


def test_switches_without_gate_happen_exactly_at_the_planned_steps():
    plan = CurriculumPlan(mod_gate_step=3, mod_force_step=5, mor_step=6, loss_gate=None)
    states, model = run_plan(Curriculum(plan), 10)
    assert [s[0] for s in states] == [False] * 3 + [True] * 7
    assert [s[1] for s in states] == [False] * 6 + [True] * 4
    assert model.calls == [(False, False), (True, False), (True, True)]  # set only on a change


def test_loss_gate_opens_early_only_when_the_ema_is_low():
    plan = CurriculumPlan(mod_gate_step=3, mod_force_step=8, mor_step=None, loss_gate=5.0)
    high, _ = run_plan(Curriculum(plan), 10, losses=lambda s: 9.0)
    assert [s[0] for s in high].index(True) == 8  # forced
    low, _ = run_plan(Curriculum(plan), 10, losses=lambda s: 2.0)
    assert [s[0] for s in low].index(True) == 3  # gate open at its first step
    # The gate is read at log steps only: with log_every 4 it is first seen at step 4.
    sparse, _ = run_plan(Curriculum(plan), 10, losses=lambda s: 2.0, log_every=4)
    assert [s[0] for s in sparse].index(True) == 4
    # A non-finite loss (a batch the batch filter skipped) leaves the EMA alone instead of shutting the gate for good.
    skipped, _ = run_plan(Curriculum(plan), 10, losses=lambda s: float("nan") if s in (0, 1) else 2.0)
    assert [s[0] for s in skipped].index(True) == 3


def test_a_curriculum_saved_before_the_ema_weight_restores_its_ema():
    c = Curriculum(CurriculumPlan(1, 2, 3, 5.0))
    run_plan(c, 4, losses=lambda s: 1.0 + s / 7)
    old = {k: v for k, v in c.state_dict().items() if k != "ema_weight"} | {"ema_count": 4}
    d = Curriculum(c.plan)
    d.load_state_dict(old)
    assert abs(d.ema() - c.ema()) < 1e-6


def test_state_round_trip_keeps_the_ema_exactly():
    c = Curriculum(CurriculumPlan(1, 2, 3, 5.0))
    run_plan(c, 4, losses=lambda s: 1.0 + s / 7)
    d = Curriculum(c.plan)
    d.load_state_dict(c.state_dict())
    assert d.state_dict() == c.state_dict()
    assert d.ema() == c.ema()
    model = FakeModel()
    d.apply(4, model)
    assert model.calls == [(True, True)]  # a restored curriculum re-applies its state to the new model


def test_a_run_records_the_switches_at_the_planned_steps(tiny_data, tmp_path):
    run = tmp_path / "run"
    code = main(["train", "--data", str(tiny_data), "--out", str(run), "--max_steps", "10", "--log_every", "1",
                 "--eval_every", "0", "--no-eval_at_start", "--mod_enable_pct", "0.3", "--mod_force_enable_pct", "0.3",
                 "--mor_enable_pct", "0.6", *TINY_RUN])
    assert code == 0
    rs = records(run, "train")
    # A record at step s describes the step with index s-1.
    assert [r["mod_active"] for r in rs] == [False] * 3 + [True] * 7
    assert [r["mor_active"] for r in rs] == [False] * 6 + [True] * 4
    assert all(r["routing_exec_frac"]["block1.mod0"] == 1.0 for r in rs[:3])  # off: every token runs
    assert all(r["routing_exec_frac"]["block1.mod0"] < 1.0 for r in rs[3:])


def test_mod_off_mor_off_keep_routing_off(tiny_data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), "--max_steps", "4", "--log_every", "1",
                 "--eval_every", "0", "--eval_batches", "1", "--mod_off", "--mor_off", *TINY_RUN]) == 0
    assert not any(r["mod_active"] or r["mor_active"] for r in records(run, "train"))
    # The evaluation before the first step runs the model the first step trains: every token through every unit.
    start = records(run, "eval")[0]
    assert start["step"] == 0 and start["val_exec_frac_causal"] == start["val_exec_frac_topk"] == 1.0


def test_a_resume_cannot_switch_off_a_router_that_is_on(tiny_data, tmp_path, capsys):
    """Once on, a router stays on: --mod_off / --mor_off on a resume after its switch are refused (they were ignored
    while the log header said "MoD off; MoR off"); given before the switch, they keep it off."""
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), "--max_steps", "8", "--log_every", "1",
                 "--eval_every", "0", "--no-eval_at_start", "--mor_enable_pct", "0.5", "--stop_at_step", "2",
                 *TINY_RUN]) == 0
    assert main(["train", "--out", str(run), "--mod_off", "--stop_at_step", "3"]) == 2
    assert "cannot set mod_off when resuming: MoD routing is on in the run's checkpoint hydra_debug_step2" in \
        capsys.readouterr().err
    assert main(["train", "--out", str(run), "--mor_off", "--stop_at_step", "6"]) == 0  # MoR would start at step 4
    assert "MoD on at step 0; MoR off" in capsys.readouterr().out
    rs = records(run, "train")
    assert [r["step"] for r in rs] == [1, 2, 3, 4, 5, 6]
    assert all(r["mod_active"] for r in rs) and not any(r["mor_active"] for r in rs)
    assert main(["train", "--out", str(run), "--no-mor_off", "--stop_at_step", "7"]) == 0
    assert records(run, "train")[-1]["mor_active"]
    assert main(["train", "--out", str(run), "--mor_off"]) == 2
    assert "cannot set mor_off when resuming: MoR routing is on" in capsys.readouterr().err


def test_a_switch_on_a_resumes_first_step_is_reported_as_one():
    """A run stopped just before a planned switch: the resumed run's first step makes it, and says so as the
    uninterrupted run does (the loaded state, not nothing, is what the first step switches from)."""
    c = Curriculum(CurriculumPlan(1, 2, 3, None))
    run_plan(c, 3)  # steps 0-2: MoD on at step 1, MoR still off
    for step, message in ((3, "curriculum: step 3: MoD on, MoR on"), (2, None)):
        d = Curriculum(c.plan)
        d.load_state_dict(c.state_dict())
        assert d.apply(step, FakeModel()) == message

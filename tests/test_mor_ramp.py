"""--mor_ramp: MoR capacities move from full depth to the configured ones in 4 levels, and resume exactly."""

import pytest

from support import tiny_model, tokens_per_unit
from hydra_lm.train.curriculum import Curriculum, CurriculumPlan
from hydra_lm.train.options import TrainConfig
from hydra_lm.cli import main
from support import TINY_RUN, train_losses


def test_capacities_ramp_in_four_levels_from_full_depth_to_the_configured_ones():
    model = tiny_model()
    configured = tokens_per_unit(model, 64)
    cfg = TrainConfig(max_steps=100, mod_enable_pct=0.0, mod_force_enable_pct=0.0, mor_enable_pct=0.2,
                      mor_ramp=True, mor_ramp_pct=0.4)
    curriculum = Curriculum(CurriculumPlan.from_config(cfg))
    levels, units = [], []
    for step in (10, 20, 33, 34, 47, 59, 60, 99):
        curriculum.apply(step, model)
        levels.append(curriculum.mor_ramp)
        units.append(tokens_per_unit(model, 64))
    assert levels == [1.0, 0.25, 0.25, 0.5, 0.75, 0.75, 1.0, 1.0]
    assert units[-1] == configured
    name = next(n for n, k in configured.items() if not n.endswith("depth0") and k < configured[n[:-1] + "0"])
    entry = configured[name[:-1] + "0"]
    seen = [u[name] for u in units[1:]]
    assert seen == sorted(seen, reverse=True) and entry > seen[0] > seen[-1] == configured[name]


@pytest.mark.parametrize("ramp", [1.5, -0.5, float("nan"), True, "1"])
def test_a_ramp_outside_0_1_is_refused(ramp):
    model = tiny_model()
    before = tokens_per_unit(model, 64)
    with pytest.raises(ValueError, match=r"mor_ramp=.* must lie in \[0, 1\]"):
        model.set_curriculum(mor_ramp=ramp)
    assert tokens_per_unit(model, 64) == before


def test_ramped_run_logs_its_levels_and_resumes_exactly(tiny_data, tmp_path):
    common = ["--data", str(tiny_data), *TINY_RUN, "--log_every", "1", "--no-eval_at_start", "--eval_every", "0",
              "--max_steps", "8", "--save_every", "8", "--mod_off", "--mor_enable_pct", "0.25", "--mor_ramp",
              "--mor_ramp_pct", "0.5"]
    assert main(["train", "--out", str(tmp_path / "straight"), *common]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces"), *common, "--stop_at_step", "4"]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces")]) == 0
    assert train_losses(tmp_path / "pieces") == train_losses(tmp_path / "straight")
    log = (tmp_path / "straight" / "train.log").read_text()
    assert all(f"capacity ramp {level}" in log for level in ("0.25", "0.5", "0.75", "1)"))

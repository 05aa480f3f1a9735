"""--mor_ramp: MoR capacities move from full depth to the configured ones in 4 levels, their FLOPs are counted
level by level, and a ramped run resumes exactly."""

import json
from unittest import mock

import pytest
import torch

from support import TINY, tiny_model, tokens_per_unit
from hydra_lm.config import HydraConfig
from hydra_lm.diagnostics.compare_runs import executed_flops_at, planned_flops
from hydra_lm.model import accounting
from hydra_lm.model.hydra import HydraModel
from hydra_lm.train.curriculum import Curriculum, CurriculumPlan
from hydra_lm.train.options import TrainConfig
from hydra_lm.train.trainer import Trainer
from hydra_lm.cli import main
from support import TINY_RUN, records, train_losses


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


def test_at_full_depth_causal_routing_runs_every_candidate_as_top_k_does():
    """The ramp's first level keeps every MoR candidate (capacity 1): the causal rule must too, though the
    thresholds were calibrated at the configured capacities (it turned away up to 22% of candidates under them)."""
    model = tiny_model()
    ids = torch.randint(0, TINY["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(1))
    for _ in range(3):  # training forwards calibrate every threshold at the configured capacities
        model(ids, targets=ids)
    model.eval()
    model.set_curriculum(mod_active=False, mor_ramp=0.0)
    with torch.no_grad():
        topk, causal = (model(ids, targets=ids, routing=mode) for mode in ("topk", "causal"))
    executed = causal["routing_stats"][:, 0]
    assert torch.equal(executed, topk["routing_stats"][:, 0]) and bool((executed == 1).all())
    torch.testing.assert_close(causal["ce_loss"], topk["ce_loss"], rtol=0, atol=1e-6)


def live_flops(model, seq_len: int) -> float:
    """Training FLOPs/token of the units as ``model`` runs them now (its curriculum's switches and MoR ramp)."""
    units = [(f"{b.name}.depth{j}", len(b.layers), k) for b in model.blocks
             for j, k in enumerate(b.tokens_per_depth(seq_len))]
    with mock.patch.object(accounting, "unit_token_counts", lambda *args: units):
        return accounting.executed_flops_per_token(model.config, seq_len, training=True)


def test_a_ramped_runs_planned_flops_count_each_level_as_the_model_runs_it():
    """A FLOPs budget buys the steps a run executes: a ramp's levels run more tokens per depth than the configured
    capacities (they used to be counted at those, under-counting a ramped variant's FLOPs)."""
    model, steps = tiny_model(), 50
    train = TrainConfig(max_steps=steps, mod_enable_pct=0.1, mod_force_enable_pct=0.1, mor_enable_pct=0.2,
                        mor_ramp=True, mor_ramp_pct=0.5, seq_len=64)
    curriculum = Curriculum(CurriculumPlan.from_config(train))
    executed = 0.0
    for step in range(steps):
        curriculum.apply(step, model)
        executed += live_flops(model, 64)
    assert planned_flops(model.config, train, steps, 1) == pytest.approx(executed, rel=1e-12)
    assert executed > planned_flops(model.config, train.replace(mor_ramp=False), steps, 1)


def test_ramped_run_logs_its_levels_counts_their_flops_and_resumes_exactly(tiny_data, tmp_path, monkeypatch):
    init = Trainer.__init__

    def with_peak(self, setup):  # the trainer measures a peak rate (for MFU) on CUDA only
        init(self, setup)
        self.peak_flops = 1e12

    monkeypatch.setattr(Trainer, "__init__", with_peak)
    common = ["--data", str(tiny_data), *TINY_RUN, "--log_every", "1", "--no-eval_at_start", "--eval_every", "0",
              "--max_steps", "8", "--save_every", "8", "--mod_off", "--mor_enable_pct", "0.25", "--mor_ramp",
              "--mor_ramp_pct", "0.5"]
    assert main(["train", "--out", str(tmp_path / "straight"), *common]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces"), *common, "--stop_at_step", "4"]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces")]) == 0
    assert train_losses(tmp_path / "pieces") == train_losses(tmp_path / "straight")
    log = (tmp_path / "straight" / "train.log").read_text()
    assert all(f"capacity ramp {level}" in log for level in ("0.25", "0.5", "0.75", "1)"))
    saved = json.loads((tmp_path / "straight" / "config.json").read_text())
    model_cfg, train = HydraConfig.from_saved(saved["model"]), TrainConfig(**saved["train"])
    rs = records(tmp_path / "straight", "train")
    assert [r["mor_ramp"] for r in rs] == [1.0, 1.0, 0.25, 0.25, 0.5, 0.75, 1.0, 1.0]
    with torch.device("meta"):
        model = HydraModel(model_cfg)
    for r in rs:  # MFU at the level the step ran
        model.set_curriculum(r["mod_active"], r["mor_active"], r["mor_ramp"])
        assert r["mfu"] == pytest.approx(live_flops(model, 32) * r["tokens_per_s"] / 1e12, rel=1e-9)
    # compare's FLOPs of the run, from its records, are the ones its plan counted
    assert executed_flops_at([8], rs, model_cfg, 32, 128)[0] == pytest.approx(planned_flops(model_cfg, train, 8, 128))

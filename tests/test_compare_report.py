"""What `hydra-lm compare`'s report and results say of the runs: the reach table's bounds, when the runs were
evaluated and how many steps they made, and the MoR depth profile."""

import pytest

from hydra_lm.config import preset_config
from hydra_lm.diagnostics.compare import plan_compare
from hydra_lm.diagnostics.compare_runs import parse_budget
from hydra_lm.diagnostics.routing_health import depth_profile


def test_the_reach_table_bounds_a_loss_reached_at_the_first_evaluation_after_the_start():
    """The start's evaluation is the untrained model (loss ~9): a line from it to the first evaluation that
    beats dense would read a time the run never showed, so that evaluation's own time is the bound."""
    from hydra_lm.diagnostics.report import first_reach, reach_rows

    evals = [{"train_s": t, "flops": 1e9 * t, "val_loss_causal": loss}
             for t, loss in ((0.0, 9.1376), (7.69, 6.6875), (15.54, 6.033))]
    assert first_reach(evals, "train_s", 7.0409) == (7.69, True)
    assert first_reach(evals, "flops", 7.0409) == (pytest.approx(7.69e9), True)
    dense = {"arch": "dense", "status": "finished", "seed": 0, "evals": [], "train_s": 15.0, "executed_flops": 3e10,
             "final": {"val_loss_causal": 7.0409}}
    hydra = {"arch": "hydra", "status": "finished", "seed": 0, "evals": evals}
    (row,) = reach_rows({"variants": {"hydra": hydra, "dense": dense}})
    assert row[3:] == ("<= 7.7", "<= 0.51", "<= 7.69e+09", "<= 0.26")
    (row,) = reach_rows({"variants": {"hydra": dict(hydra, status="diverged"), "dense": dense}})
    assert row[0] == "hydra (diverged)"  # it reached the loss before it stopped: kept, saying how it ended


def test_the_report_says_when_the_runs_were_evaluated_and_how_many_steps_they_made(tiny_data, tmp_path):
    """From the recorded settings: no start evaluation under --no-eval_at_start; under a seconds budget
    --eval_every counts the schedule's thousandths of the time (the trainer's clock), and a run's steps are those
    it made, not the clock's 1000."""
    from hydra_lm.diagnostics.compare_results import collect_results
    from hydra_lm.diagnostics.report import write_report

    def report(budget, evals, **extra):
        shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32, **extra}
        results = collect_results(plan_compare(str(tiny_data), str(tmp_path / budget), parse_budget(budget),
                                               ["hydra"], [], evals, shared))
        results["variants"]["hydra"]["steps"] = 13
        write_report(results, [], tmp_path / "report.md")
        text = (tmp_path / "report.md").read_text()
        return text.split("Validation loss is measured ")[1].split(", with causal routing")[0], text

    spacing, text = report("seconds=60", None, eval_every=50, eval_at_start=False)
    assert spacing == ("every 50/1000 of the training-time budget (--eval_every 50 counts steps of the schedule, "
                       "which a seconds budget divides into 1000) and at the end")
    assert "13 steps in its training-time budget" in text and "1000 scheduled steps" not in text
    assert report("seconds=60", None, eval_every=20, max_steps=200)[0].startswith(
        "at the start, every 20/200 of the training-time budget (--eval_every 20 counts")
    assert report("seconds=60", 4)[0] == "at the start, every 1/4 of the training-time budget, and at the end"
    spacing, text = report("tokens=1280", 2, eval_at_start=False)
    assert spacing == "every ceil(steps / 2) steps and at the end" and "13 of 10 scheduled steps" in text
    assert report("tokens=1280", 1)[0] == "at the start and at the end"
    assert report("tokens=1280", None, eval_every=0, eval_at_start=False)[0] == "at the end only (--eval_every 0)"


def test_the_mor_depth_profile_is_relative_to_each_blocks_entries_and_only_of_mor_models():
    """A row's share at depth 1 of a MoD block is MoD's entry share (0.125), not MoR's doing: averaged in, the
    histogram read 0.56 at depth 1 where every entered token runs it. Shares as an evaluation reports them (of the
    row; the debug preset: block0 MoR only, block1 MoD then MoR), from a run of the reviewer's."""
    def router(target, causal, active=True):
        return {"target": target, "exec_causal": causal, "exec_topk": target, "active": active}
    routers = {"block0.mor1": router(0.125, 0.076171875), "block1.mod0": router(0.125, 0.08984375),
               "block1.mor1": router(0.015625, 0.005859375)}
    profile = depth_profile(preset_config("debug"), routers)
    assert profile["target"] == [1.0, pytest.approx(0.125)]
    assert profile["causal"] == [1.0, pytest.approx((0.076171875 + 0.005859375 / 0.08984375) / 2)]
    # MoR alone: every block enters the whole row.
    mor_only = {"block0.mor1": router(0.125, 0.1), "block1.mor1": router(0.125, 0.15)}
    assert depth_profile(preset_config("debug", mod_enabled=False), mor_only)["causal"] == [1.0, pytest.approx(0.125)]
    # A block causal MoD let no token into: none of its entries reach a depth (not a division by zero).
    starved = {**routers, "block1.mod0": router(0.125, 0.0), "block1.mor1": router(0.015625, 0.0)}
    assert depth_profile(preset_config("debug"), starved)["causal"] == [0.5, pytest.approx(0.076171875 / 2)]
    # Variants without MoR have no depth profile (and no bars in the plot).
    assert depth_profile(preset_config("debug", mor_enabled=False), {"block1.mod0": router(0.125, 0.1)}) is None
    assert depth_profile(preset_config("debug", recursions=1), {"block1.mod0": router(0.125, 0.1)}) is None
    assert depth_profile(preset_config("debug", arch="dense"), {}) is None
    kept_off = {name: dict(r, active=not name.endswith("mor1")) for name, r in routers.items()}  # --mor_off
    assert depth_profile(preset_config("debug"), kept_off) is None

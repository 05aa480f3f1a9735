"""`hydra-lm compare` over several seeds and learning rates: the spread and margin over seeds, each variant's best
learning rate and the grid's extension past it, and seeds of separate studies pooled into one report."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from hydra_lm.diagnostics.compare_results import lr_extensions, lr_sweep
from hydra_lm.diagnostics.report import margin_statistics, seed_margin
from support import compare


@pytest.mark.slow
def test_seeds_train_every_variant_per_seed_and_report_the_spread(tiny_data, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(tiny_data, out, "--budget", "tokens=512", "--variants", "hydra", "dense", "--evals", "1",
                   "--seeds", "3", "5") == 0
    printed = capsys.readouterr().out
    # Trained seed by seed (a study cut short still has every variant), reported variant by variant.
    trained = [line.split()[2] for line in printed.splitlines() if line.startswith("compare: training ")]
    assert trained == ["hydra.seed3", "dense.seed3", "hydra.seed5", "dense.seed5"]
    results = json.loads((out / "results.json").read_text())
    assert list(results["variants"]) == ["hydra.seed3", "hydra.seed5", "dense.seed3", "dense.seed5"]
    assert results["settings"]["seed"] == [3, 5]
    finals = {name: v["final"]["val_loss_causal"] for name, v in results["variants"].items()}
    assert finals["hydra.seed3"] != finals["hydra.seed5"]  # the seed reaches model init and data order
    for name in ("hydra", "dense"):
        summary = results["across_seeds"][name]
        losses = [finals[f"{name}.seed3"], finals[f"{name}.seed5"]]
        assert summary["seeds"] == [3, 5] and summary["causal"] == losses
        assert summary["mean"] == pytest.approx(np.mean(losses))
        assert summary["std"] == pytest.approx(np.std(losses, ddof=1))
        assert (summary["min"], summary["max"]) == (min(losses), max(losses))
    report = (out / "report.md").read_text()
    assert "## Across seeds" in report and "seeds 3, 5" in report and "| hydra | 3 5 |" in report
    assert "Best HYDRA variant hydra" in report and "best dense variant dense" in printed
    assert "passes over the training split" not in printed  # 512 tokens: a fraction of one pass
    # A seed's run is the run a compare without --seeds trains with that --seed.
    assert compare(tiny_data, tmp_path / "one", "--budget", "tokens=512", "--variants", "hydra", "--evals", "1",
                   "--seed", "5") == 0
    single = json.loads((tmp_path / "one" / "results.json").read_text())["variants"]["hydra"]
    assert single["final"]["val_loss_causal"] == pytest.approx(finals["hydra.seed5"], abs=1e-6)
    assert "across_seeds" not in json.loads((tmp_path / "one" / "results.json").read_text())


def test_the_report_under_lrs_names_the_grid_not_a_learning_rate_no_run_trained_at(tiny_data, tmp_path):
    from hydra_lm.diagnostics.compare import plan_compare
    from hydra_lm.diagnostics.compare_results import collect_results
    from hydra_lm.diagnostics.compare_runs import parse_budget
    from hydra_lm.diagnostics.report import write_report

    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32}
    plan = plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("tokens=1k"), ["hydra"], [], 1, shared,
                        lrs=[1e-3, 3e-3])
    results = collect_results(plan)
    write_report(results, [], tmp_path / "report.md")
    header = (tmp_path / "report.md").read_text().splitlines()[2]
    assert "peak learning rates from the --lrs grid (below) (wsd)" in header
    assert f"learning rate {results['settings']['lr']:g}" not in header and "of their own" not in header


@pytest.mark.slow
def test_lrs_train_every_variant_per_learning_rate_and_report_each_ones_best(tiny_data, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(tiny_data, out, "--budget", "tokens=512", "--variants", "hydra", "dense", "--evals", "1",
                   "--lrs", "3e-2", "1e-4", "--seeds", "0", "1") == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    names = [f"{v}.lr{lr}.seed{s}" for v in ("hydra", "dense") for lr in ("0.0001", "0.03") for s in (0, 1)]
    assert sorted(results["variants"]) == sorted(names)
    for name, v in results["variants"].items():
        lr = float(name.split(".lr")[1].split(".seed")[0])
        assert v["lr"] == lr and v["min_lr"] == pytest.approx(lr / 10) and v["swept_from"] == name.split(".")[0]
    for family in ("hydra", "dense"):
        sweep = results["lr_sweep"][family]
        means = [np.mean([results["variants"][f"{family}.lr{lr}.seed{s}"]["final"]["val_loss_causal"]
                          for s in (0, 1)]) for lr in ("0.0001", "0.03")]
        assert sweep["lrs"] == [1e-4, 3e-2] and sweep["causal"] == pytest.approx(means)
        best = [1e-4, 3e-2][int(np.argmin(means))]
        assert sweep["best_lr"] == best and sweep["best_causal"] == pytest.approx(min(means))
        # Two learning rates: the best is always at an end of the grid, and the report says so.
        assert sweep["best_at_edge"] == ("smallest" if best == 1e-4 else "largest")
        assert any(w.startswith(f"{family}: its best learning rate") for w in results["warnings"])
    report = (out / "report.md").read_text()
    assert "## Learning rate per variant" in report and "| variant | lr 0.0001 | lr 0.03 | best lr |" in report
    assert "best lr" in printed and "extend the grid" in printed


def test_lr_sweep_marks_a_best_inside_the_grid_as_settled():
    def run(family, lr, seed):
        return SimpleNamespace(name=f"{family}.lr{lr:g}.seed{seed}", values={"lr": lr},
                               variant=SimpleNamespace(swept_from=family))

    runs = [run("hydra", lr, s) for lr in (1e-3, 3e-3, 1e-2) for s in (0, 1)] + [run("dense", 1e-3, 0)]
    loss = {1e-3: 3.0, 3e-3: 2.5, 1e-2: 2.8}
    variants = {r.name: {"status": "finished",
                         "final": {"val_loss_causal": loss[r.values["lr"]] + 0.01 * int(r.name[-1])}} for r in runs}
    variants["hydra.lr0.01.seed1"] = {"status": "diverged", "final": None}  # the rate failed: no mean
    variants["hydra.lr0.001.seed1"]["rollbacks"] = 1  # finished at a lower LR than its own: failed too
    sweep = lr_sweep(runs, variants)
    assert sweep["hydra"] == {"lrs": [1e-3, 3e-3, 1e-2], "causal": [None, pytest.approx(2.505), None],
                              "n_seeds": [1, 2, 1], "planned_seeds": [2, 2, 2], "failed": [True, False, True],
                              "best_lr": 3e-3, "best_causal": pytest.approx(2.505), "best_at_edge": None}
    assert sweep["dense"]["best_at_edge"] is None  # one learning rate: nothing to extend


def test_a_learning_rate_where_some_seeds_diverged_is_failed_not_best_and_not_extended_past():
    """A mean over the seeds that survived ranks an unstable rate by its lucky seed: 3e-3 with one seed at 3.40
    and two diverged would be best, and --lr_extend would try 9e-3 next."""
    from hydra_lm.diagnostics.compare_results import across_seeds
    from hydra_lm.diagnostics.report import lr_rows, seed_rows

    def run(lr, seed):
        return SimpleNamespace(name=f"hydra.lr{lr:g}.seed{seed}", values={"lr": lr}, seed=seed,
                               variant=SimpleNamespace(swept_from="hydra", name=f"hydra.lr{lr:g}", arch="hydra",
                                                       budget_scale=1.0))

    def finished(loss):
        return {"status": "finished", "rollbacks": 0, "final": {"val_loss_causal": loss}}
    runs = [run(lr, s) for lr in (1e-3, 3e-3) for s in (0, 1, 2)]
    variants = {r.name: finished(loss) for r, loss in zip(runs, (3.50, 3.52, 3.48, 3.40, None, None))}
    variants["hydra.lr0.003.seed1"] = {"status": "diverged", "rollbacks": 2, "final": {"val_loss_causal": 7.9}}
    sweep = lr_sweep(runs, variants)
    hydra = sweep["hydra"]
    assert hydra["best_lr"] == 1e-3 and hydra["best_causal"] == pytest.approx(3.50)
    assert hydra["causal"] == [pytest.approx(3.50), None] and hydra["failed"] == [False, True]
    assert hydra["n_seeds"] == [3, 1] and hydra["planned_seeds"] == [3, 3]
    assert lr_extensions(sweep) == {"hydra": pytest.approx(3.33e-4)}  # below the best, not towards 9e-3
    results = {"lr_sweep": sweep}
    assert lr_rows(results) == [("hydra", "3.5000 (n=3)", "failed (2 of 3 unstable)", "0.001 (the smallest tried)")]
    # A seed not trained yet (or raised): no mean over the others either, and no failure.
    variants = {r.name: finished(3.5) for r in runs}
    variants["hydra.lr0.003.seed2"] = {"status": "unfinished", "final": None}
    sweep = lr_sweep(runs, variants)
    assert sweep["hydra"]["causal"] == [3.5, None] and sweep["hydra"]["failed"] == [False, False]
    assert lr_rows({"lr_sweep": sweep})[0][2] == "- (2 of 3 done)"
    # Across seeds: how many of the planned seeds a mean took, and why the others are left out.
    variants = {r.name: finished(loss) for r, loss in zip(runs, (3.50, 3.52, 3.48, 3.40, None, 3.6))}
    variants["hydra.lr0.003.seed2"]["status"] = "diverged"
    summary = across_seeds(runs, variants)
    assert summary["hydra.lr0.001"]["complete"] and summary["hydra.lr0.001"]["planned"] == [0, 1, 2]
    three = summary["hydra.lr0.003"]
    assert (three["seeds"], three["mean"], three["complete"]) == ([0], 3.40, False)
    assert three["left_out"] == {"1": "non-finite", "2": "diverged"}
    rows = seed_rows({"across_seeds": summary})
    assert rows[0][1] == "0 1 2" and rows[1][1] == "0 (1 of 3; left out: 1 non-finite, 2 diverged)"
    # A seed that rolled back finished at a reduced learning rate: left out, not averaged as the rate's.
    variants["hydra.lr0.001.seed1"]["rollbacks"] = 1
    one = across_seeds(runs, variants)["hydra.lr0.001"]
    assert one["left_out"] == {"1": "rolled back"} and one["seeds"] == [0, 2] and not one["complete"]


def test_lr_extensions_step_past_the_end_a_best_sits_at_by_the_grids_ratio_there():
    def entry(lrs, edge):
        return {"lrs": lrs, "best_at_edge": edge}

    sweep = {"hydra": entry([6e-4, 1.5e-3, 3e-3], "largest"), "dense": entry([1e-3, 3e-3], "smallest"),
             "d3": entry([6e-4, 1.5e-3, 3e-3], None), "one": entry([1e-3], None)}
    assert lr_extensions(sweep) == {"hydra": 6e-3, "dense": pytest.approx(3.33e-4)}


@pytest.mark.slow
def test_lr_extend_trains_past_the_grids_end_until_the_best_is_bracketed_and_resumes_as_done(tiny_data, tmp_path,
                                                                                             capsys):
    out = tmp_path / "cmp"
    args = ("--budget", "tokens=1k", "--variants", "hydra", "--evals", "1", "--lrs", "1e-4", "1e-3",
            "--lr_extend", "1")
    assert compare(tiny_data, out, *args) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    first = {lr: results["variants"][f"hydra.lr{lr:g}"]["final"]["val_loss_causal"] for lr in (1e-4, 1e-3)}
    # One step past whichever end won the first round, at the grid's ratio (10x).
    beyond = 1e-2 if first[1e-3] < first[1e-4] else 1e-5
    assert f"hydra -> {beyond:g}" in printed
    sweep = results["lr_sweep"]["hydra"]
    assert sweep["lrs"] == sorted([1e-4, 1e-3, beyond])
    assert results["variants"][f"hydra.lr{beyond:g}"]["lr"] == beyond
    at_edge = sweep["best_lr"] in (min(sweep["lrs"]), max(sweep["lrs"]))
    assert any("extend the grid" in w for w in results["warnings"]) == at_edge  # one round only: may remain
    assert compare(tiny_data, out, *args) == 0  # the same command again: both rounds' runs are done
    again = capsys.readouterr().out
    assert "compare: training" not in again and again.count("not retrained") == 2 + 3


def test_plots_give_the_seeds_of_one_variant_one_colour_and_other_variants_others():
    from hydra_lm.diagnostics.plots import _family_colors

    names = [f"v{i}.seed{s}" for i in range(6) for s in range(3)]  # 18 runs: tab10 would repeat per run
    colors, runs = _family_colors({n: {"variant": n.split(".")[0]} for n in names})
    assert runs == {f"v{i}": 3 for i in range(6)}
    assert all(colors[f"v{i}.seed0"] == colors[f"v{i}.seed{s}"] for i in range(6) for s in (1, 2))
    assert len({colors[f"v{i}.seed0"] for i in range(6)}) == 6


def test_the_seed_margin_gives_welchs_t_and_how_many_hydra_seeds_beat_every_dense_one():
    hydra, dense = [1.0051, 1.0061, 0.9958, 0.9997], [1.0025, 1.0125, 1.0091, 1.0114]
    m = margin_statistics(hydra, dense)
    assert m["difference"] == pytest.approx(np.mean(dense) - np.mean(hydra))
    # scipy.stats.ttest_ind(dense, hydra, equal_var=False) on these: t 2.188064, df 5.967963
    assert m["t"] == pytest.approx(2.188064, abs=1e-6) and m["df"] == pytest.approx(5.967963, abs=1e-6)
    assert m["below_every_dense"] == 2  # 0.9958 and 0.9997 are below dense's best, 1.0025
    summary = {name: {"arch": arch, "seeds": [1, 2, 3, 4], "causal": x, "mean": float(np.mean(x)), "min": min(x),
                      "max": max(x)} for name, arch, x in (("b12r1", "hydra", hydra), ("d7", "dense", dense))}
    text = seed_margin({"across_seeds": summary})
    assert "0.0072 nats below the best dense variant d7" in text and "2.2 standard errors" in text
    assert "2 of 4 HYDRA seeds end below every dense seed" in text
    two = {name: dict(v, seeds=[1, 2], causal=v["causal"][:2]) for name, v in summary.items()}
    assert "too few for t to say much" in seed_margin({"across_seeds": two})  # about 1 degree of freedom
    assert "too few" not in text
    # One seed a side: no spread to weigh the difference by, so no t.
    one = {name: dict(v, seeds=[1], causal=v["causal"][:1], mean=v["causal"][0], min=v["causal"][0], max=v["causal"][0])
           for name, v in summary.items()}
    assert margin_statistics(hydra[:1], dense[:1])["t"] is None
    assert "standard errors" not in seed_margin({"across_seeds": one}) and "above the best dense" in seed_margin(
        {"across_seeds": one})
    # Only equal budgets and whole seed sets are ranked: a HYDRA variant given twice the budget, or one whose other
    # seeds diverged, is no rival however low its mean.
    lucky = {"arch": "hydra", "seeds": [1], "causal": [0.90], "mean": 0.90, "min": 0.90, "max": 0.90}
    rivals = {**summary, "twice": dict(lucky, budget_scale=2.0, complete=True),
              "survivor": dict(lucky, complete=False, planned=[1, 2, 3, 4])}
    text = seed_margin({"across_seeds": rivals})
    assert text.startswith("Best HYDRA variant b12r1") and "Not ranked: survivor, twice" in text


def test_seeds_of_separate_studies_pool_into_one_report_without_training_again(tiny_data, tmp_path, capsys):
    """Seeds run on different machines: copy one study's seed runs into the other and compare again."""
    common = ("--budget", "tokens=256", "--variants", "hydra", "--evals", "1")
    assert compare(tiny_data, tmp_path / "a", *common, "--seeds", "3") == 0
    assert compare(tiny_data, tmp_path / "b", *common, "--seeds", "5") == 0
    shutil.copytree(tmp_path / "b" / "runs" / "hydra.seed5", tmp_path / "a" / "runs" / "hydra.seed5")
    capsys.readouterr()
    assert compare(tiny_data, tmp_path / "a", *common, "--seeds", "3", "5") == 0
    assert "compare: training " not in capsys.readouterr().out
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    alone = json.loads((tmp_path / "b" / "results.json").read_text())["variants"]["hydra.seed5"]
    assert results["across_seeds"]["hydra"]["seeds"] == [3, 5]
    assert results["variants"]["hydra.seed5"]["final"] == alone["final"]


def test_plots_of_variants_without_an_evaluation_say_so_without_a_warning(tmp_path):
    import warnings

    from hydra_lm.diagnostics.plots import write_compare_plots

    results = {"variants": {"hydra": {"evals": [], "routing": {}, "depth_profile": None},
                            "dense": {"evals": [], "routing": {}, "depth_profile": None}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend" among them
        paths = write_compare_plots(results, tmp_path)
    assert len(paths) == 6 and all(p.stat().st_size > 0 for p in paths)

"""`hydra-lm compare` and `hydra-lm scaling` end to end on tiny runs, the trainer's time budget, and
clear one-line errors for bad requests."""

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from hydra_lm.cli import main
from hydra_lm.diagnostics.compare import plan_compare
from hydra_lm.diagnostics.compare_runs import parse_budget, planned_flops
from hydra_lm.diagnostics.report import _own_optimizers
from hydra_lm.diagnostics.variants import parameter_count, parse_custom_variant
from hydra_lm.model.accounting import executed_flops_per_token
from hydra_lm.infer import eval_run
from hydra_lm.train import lr_at
from hydra_lm.train.clock import due_after_step
from hydra_lm.train.options import OPTIMIZER_LR_SCALE
from support import TINY_RUN, compare, records, write_corpus

PLOTS = ("loss_vs_tokens.png", "loss_vs_flops.png", "loss_vs_seconds.png", "routing_exec_fraction.png",
         "mor_depth_histogram.png", "causal_topk_gap.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_compare_trains_reports_and_skips_finished_variants(tiny_data, tmp_path, capsys):
    out = tmp_path / "cmp"
    # 1,024 tokens at 4 x 32 tokens/step: 8 steps per variant, evaluated at 0, 4 and 8.
    assert compare(tiny_data, out, "--budget", "tokens=1k", "--variants", "hydra", "dense", "--evals", "2") == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("variant "))
    assert "tok/s" in lines[header]
    assert lines[header + 2].startswith("hydra ") and lines[header + 3].startswith("dense ")
    results = json.loads((out / "results.json").read_text())
    assert results["budget"] == {"kind": "tokens", "value": 1000.0}
    assert list(results["variants"]) == ["hydra", "dense"]
    dense = results["variants"]["dense"]
    assert dense["overrides"]["arch"] == "dense" and dense["overrides"]["n_layers"] >= 1
    for v in results["variants"].values():
        assert v["status"] == "finished" and v["steps"] == 8 and v["tokens"] == 8 * 128
        assert [p["step"] for p in v["evals"]] == [0, 4, 8]
        assert v["executed_flops"] > 0 and v["train_s"] > 0 and v["tokens_per_s"] > 0 and v["peak_memory_mb"] > 0
        assert (v["optimizer"], v["lr"]) == ("adamw", results["settings"]["lr"])
        assert v["evals"][-1]["flops"] == pytest.approx(v["executed_flops"])
        # The reported final losses are what `hydra-lm eval` measures on the saved checkpoint.
        ev = eval_run(out / v["run_dir"], max_batches=2, device="cpu")
        assert ev["step"] == 8
        assert v["final"]["val_loss_causal"] == pytest.approx(ev["val_loss_causal"], abs=1e-5)
        assert v["final"]["val_loss_topk"] == pytest.approx(ev["val_loss_topk"], abs=1e-5)
        assert v["final"]["gap"] == pytest.approx(ev["val_loss_causal"] - ev["val_loss_topk"], abs=1e-5)
    hydra = results["variants"]["hydra"]
    assert hydra["device"] == dense["device"] == "cpu"
    assert 0 <= hydra["final"]["val_agreement"] <= 1 and dense["final"]["val_agreement"] is None
    assert "agree" in lines[header] and f"{hydra['final']['val_agreement']:.1%}" in lines[header + 2]
    rate = hydra["executed_flops"] / hydra["train_s"] / 1e12  # what the variant made of the device per second
    assert "exec TFLOP/s" in lines[header] and f"{rate:.3g}" in lines[header + 2].split()
    assert hydra["routing"] and all(0 <= r["exec_causal"] <= 1 and 0 < r["target"] <= 1
                                    for r in hydra["routing"].values())
    assert len(hydra["depths"]["causal"]) == 2 and dense["routing"] == {} and dense["depths"] is None
    report = (out / "report.md").read_text()
    assert "| hydra |" in report and "| dense |" in report and "## Routing health" in report
    assert "| causal / target |" in report  # the ratio the warnings judge, beside the top-k share
    assert "- **hydra** (hydra on cpu, " in report
    assert "## Time and compute to each dense model's final loss" in report and "| hydra | dense |" in report
    for name in PLOTS:
        blob = (out / name).read_bytes()
        assert blob.startswith(PNG_SIGNATURE) and len(blob) > 5000, name
        assert f"({name})" in report

    # Only the newest checkpoint of a run is kept (the trainer keeps three by default); a marker that
    # recorded another count (as before compare set it) still names the same finished run.
    for name in ("hydra", "dense"):
        assert [p.name for p in (out / "runs" / name / "checkpoints").glob("*_step*")] == ["hydra_debug_step8"]
        saves = [line for line in (out / "runs" / name / "train.log").read_text().splitlines()
                 if "saved checkpoint" in line]
        assert [line.rsplit("_step", 1)[1] for line in saves] == ["4", "8"]  # the middle and the end
    marker_path = out / "runs" / "dense" / "compare.json"
    marker = json.loads(marker_path.read_text())
    marker_path.write_text(json.dumps({**marker, "settings": {**marker["settings"], "keep_checkpoints": 3,
                                                                "save_every": 2}}))
    metrics = {name: (out / "runs" / name / "metrics.jsonl").read_bytes() for name in ("hydra", "dense")}
    assert compare(tiny_data, out, "--budget", "tokens=1k", "--variants", "hydra", "dense", "--evals", "2") == 0
    again = capsys.readouterr().out
    assert again.count("finished earlier") == 2 and "eval step" not in again  # nothing retrained
    assert {name: (out / "runs" / name / "metrics.jsonl").read_bytes() for name in metrics} == metrics
    assert json.loads((out / "results.json").read_text())["variants"]["hydra"]["final"] == hydra["final"]
    # A changed budget would make the finished run a different experiment: refused, not mixed in.
    assert compare(tiny_data, out, "--budget", "tokens=2k", "--variants", "hydra") == 2
    assert "other settings (eval_every, max_steps)" in capsys.readouterr().err


def test_a_run_cut_short_resumes_only_under_the_settings_it_started_with(tiny_data, tmp_path, monkeypatch, capsys):
    import signal

    from hydra_lm.train.step import TrainStep

    micro, calls = TrainStep.micro, []

    def stopped_at_step_3(self, inputs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGTERM)
        return micro(self, inputs)
    monkeypatch.setattr(TrainStep, "micro", stopped_at_step_3)
    out = tmp_path / "cmp"
    assert compare(tiny_data, out, "--budget", "tokens=1k", "--variants", "hydra") == 130
    monkeypatch.setattr(TrainStep, "micro", micro)
    capsys.readouterr()
    assert compare(tiny_data, out, "--budget", "tokens=1k", "--variants", "hydra", "--lr", "0.01") == 2
    assert "was trained by an earlier compare with other settings (lr" in capsys.readouterr().err
    assert compare(tiny_data, out, "--budget", "tokens=1k", "--variants", "hydra") == 0
    assert json.loads((out / "runs" / "hydra" / "compare.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("left", ["metrics", "checkpoint", "unreadable marker"])
def test_a_run_directory_compare_did_not_start_is_refused_not_resumed(tiny_data, tmp_path, left):
    """A `hydra-lm train` run left at a variant's path: resumed under compare's settings, its steps would join the
    study's results."""
    run_dir = tmp_path / "cmp" / "runs" / "hydra"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 5, "loss": 7.0}\n')
    if left == "checkpoint":
        (run_dir / "metrics.jsonl").unlink()
        (run_dir / "checkpoints" / "hydra_debug_step5").mkdir(parents=True)
    elif left == "unreadable marker":
        (run_dir / "compare.json").write_text('{"status": "fini')
    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32}
    with pytest.raises(ValueError, match=f"{run_dir} holds a run .* with (no|an unreadable) compare marker .*use a "
                                         "new --out directory, or remove that run directory"):
        plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("tokens=1k"), ["hydra"], [], 1, shared)
    shutil.rmtree(run_dir)
    run_dir.mkdir()  # a directory without a run's checkpoints or metrics is compare's to start
    plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("tokens=1k"), ["hydra"], [], 1, shared)


def test_evaluations_every_n_steps_are_reported_as_such_and_not_with_evals(tiny_data, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare(tiny_data, out, "--budget", "tokens=1k", "--variants", "hydra", "--eval_every", "3",
                   "--evals", "2") == 2
    assert "--evals and --eval_every both set when to evaluate" in capsys.readouterr().err
    assert compare(tiny_data, out, "--budget", "tokens=1k", "--variants", "hydra", "--eval_every", "3") == 0
    results = json.loads((out / "results.json").read_text())
    assert [p["step"] for p in results["variants"]["hydra"]["evals"]] == [0, 3, 6, 8]
    assert "every 3 steps (--eval_every)" in (out / "report.md").read_text()


def test_compare_refuses_bad_requests_with_one_line(tiny_data, tmp_path, capsys):
    no_val = tmp_path / "no_val"
    assert main(["prepare", "--inputs", str(write_corpus(tmp_path / "corpus", n_docs=6, words=50)), "--out",
                 str(no_val), "--vocab_size", "280", "--val_fraction", "0", "--no_progress"]) == 0
    capsys.readouterr()
    cases = [
        (["--budget", "tokens"], "KIND=N"),
        (["--budget", "watts=5"], "one of tokens, flops, seconds"),
        (["--budget", "tokens=0"], "positive"),
        (["--budget", "flops=lots"], "not a number"),
        (["--budget", "seconds=1k"], "seconds takes the suffixes s, m or h"),  # 1k seconds or 1 minute?
        (["--budget", "tokens=10h"], "tokens takes the suffixes k, M, G, T or P"),
        (["--budget", "tokens=1k", "--variants", "hydar"], "did you mean hydra?"),
        (["--budget", "tokens=1k", "--variant", "cap:mod_capacty=0.5"], "did you mean mod_capacity"),
        (["--budget", "tokens=1k", "--variant", "dense:n_layers=3"], "built-in"),
        (["--budget", "tokens=1k", "--variant", "a:mod_capacity=0.5,mod_capacity=0.9"],
         "--variant a: mod_capacity is given twice"),
        # A setting the variant's model or trainer rejects names the variant.
        (["--budget", "tokens=1k", "--variant", "a:mod_capacity=1.5"], "--variant a: HydraConfig.mod_capacity=1.5"),
        (["--budget", "tokens=1k", "--variant", "a:mod_enable_pct=2"], "--variant a: mod_enable_pct=2.0 must lie"),
        (["--budget", "tokens=1k", "--max_steps", "5"], "--max_steps cannot be given"),
        (["--budget", "tokens=1k", "--arch", "dense"], "variants choose the architecture"),
        # What the device cannot run is refused before the first variant trains, naming the variant.
        (["--budget", "tokens=1k", "--variant", "f8:experimental_fp8=true"], "--variant f8: --experimental_fp8 needs"),
        (["--budget", "tokens=1k", "--variant", "a8:optimizer=adam8bit"], "--variant a8: --optimizer adam8bit"),
        (["--budget", "tokens=1k", "--cuda_graph"], "--cuda_graph needs a CUDA device"),
        (["--budget", "tokens=1k", "--seed", "1", "--seeds", "0", "1"], "give one of them"),
        (["--budget", "tokens=1k", "--seeds", "0", "0"], "distinct seeds"),
        (["--budget", "tokens=1k", "--lr", "1e-3", "--lrs", "1e-3", "2e-3"], "--lr and --lrs: give one of them"),
        (["--budget", "tokens=1k", "--lrs", "1e-3", "1e-3"], "distinct learning rates > 0"),
        (["--budget", "tokens=1k", "--lrs", "0"], "distinct learning rates > 0"),
        (["--budget", "tokens=1k", "--lrs", "1e-3", "--variant", "slow:lr=1e-4"], "slow sets lr itself"),
        (["--budget", "tokens=1k", "--lr_extend", "1"], "with --lrs"),
        (["--budget", "tokens=1k", "--lrs", "1e-3", "--lr_extend", "-1"], "rounds >= 0"),
        (["--budget", "tokens=1k", "--gpus", "0"], "at least 1"),
        (["--budget", "tokens=1k", "--gpus", "2"], "this machine has 0 CUDA GPU(s)"),
        (["--budget", "tokens=1k", "--dataset", str(tiny_data)], "--data and --dataset both name the training data"),
    ]
    for extra, message in cases:
        assert compare(tiny_data, tmp_path / "x", *extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("hydra-lm compare: error:") and message in err and err.count("\n") == 1, (extra, err)
    assert compare(tmp_path / "missing", tmp_path / "x", "--budget", "tokens=1k") == 2
    assert "does not exist" in capsys.readouterr().err
    assert compare(no_val, tmp_path / "x", "--budget", "tokens=1k") == 2
    assert "no validation split" in capsys.readouterr().err
    assert not (tmp_path / "x" / "runs").exists()  # nothing was trained


@pytest.mark.slow
def test_gpus_train_the_runs_in_parallel_workers_with_the_sequential_results(tiny_data, tmp_path, monkeypatch,
                                                                            capsys):
    import torch

    # Two workers, one per (pretended) GPU; on this CPU machine each trains on the CPU. The GPUs are the
    # ones CUDA_VISIBLE_DEVICES leaves this process, by their names there.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    out = tmp_path / "cmp"
    assert compare(tiny_data, out, "--budget", "tokens=512", "--variants", "hydra", "dense", "vanilla", "--evals",
                   "1", "--gpus", "2") == 0
    printed = capsys.readouterr().out
    assert "GPU 0 takes the next unfinished run" in printed and "GPU 1 takes the next unfinished run" in printed
    logs = [(out / f"compare.gpu{gpu}.log").read_text() for gpu in (0, 1)]
    # Each worker holds half of the host's cores for its threads and its compilation.
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    for log, device in zip(logs, ("3", "5")):
        assert f"CUDA_VISIBLE_DEVICES={device}, {share} CPU threads, {share} compile threads)" in log
    # Each run trained once, by whichever worker was free first.
    for name in ("hydra", "dense", "vanilla"):  # three runs, two workers: one takes a second run when free
        assert sum(f"compare: training {name} " in log for log in logs) == 1, name
    results = json.loads((out / "results.json").read_text())
    assert [v["status"] for v in results["variants"].values()] == ["finished"] * 3
    # The same run as one trained in this process.
    assert compare(tiny_data, tmp_path / "one", "--budget", "tokens=512", "--variants", "dense", "--evals", "1") == 0
    single = json.loads((tmp_path / "one" / "results.json").read_text())["variants"]["dense"]
    assert single["final"]["val_loss_causal"] == pytest.approx(results["variants"]["dense"]["final"]["val_loss_causal"],
                                                               abs=1e-6)
    # Everything finished: a second call trains nothing and starts no worker.
    assert compare(tiny_data, out, "--budget", "tokens=512", "--variants", "hydra", "dense", "vanilla", "--evals",
                   "1", "--gpus", "2") == 0
    assert "takes the next unfinished run" not in capsys.readouterr().out


def test_a_gpu_workers_failed_run_leaves_its_traceback_in_its_log_and_the_next_runs_go_on(tmp_path, monkeypatch):
    """A run that raises in a worker: its traceback goes to the worker's log (not to a stream closed by then),
    the worker trains the runs after it, and exits non-zero so the command names the log."""
    import multiprocessing

    from hydra_lm.diagnostics import compare as cmp

    trained = tmp_path / "trained"

    def train_runs(plan, names):
        if names == ["bad"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        with open(trained, "a") as f:
            f.write(f"{names[0]}\n")
        return 0

    monkeypatch.setattr(cmp, "train_runs", train_runs)
    monkeypatch.setattr(cmp, "plan_compare", lambda *args: None)
    monkeypatch.setattr(cmp, "parse_budget", lambda budget: None)
    context = multiprocessing.get_context("fork")  # the child keeps the patches
    queue = context.Queue()
    for name in ("good", "bad", "last", None):
        queue.put(name)
    log = tmp_path / "compare.gpu0.log"
    worker = context.Process(target=cmp._gpu_worker, args=(0, "0", 1, queue, (None,) * 10, str(log)))
    worker.start()
    worker.join(60)
    assert worker.exitcode == 1
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: operation not permitted when stream is capturing" in text
    assert "run bad failed (traceback above)" in text
    assert trained.read_text().split() == ["good", "last"]


@pytest.mark.slow
def test_compare_warns_when_a_run_repeats_the_training_split(tiny_data, tmp_path, capsys):
    train_tokens = json.loads((tiny_data / "meta.json").read_text())["token_counts"]["train"]
    budget = 128 * (train_tokens // 128 + 40)  # a little over one pass, in whole steps of 4 x 32 tokens
    assert compare(tiny_data, tmp_path / "cmp", "--budget", f"tokens={budget}", "--variants", "dense",
                   "--evals", "1", "--no-eval_at_start") == 0
    dense = json.loads((tmp_path / "cmp" / "results.json").read_text())["variants"]["dense"]
    assert dense["epochs"] == pytest.approx(budget / train_tokens) and dense["epochs"] > 1
    assert f"dense: trained {budget / train_tokens:.1f} passes over the training split" in capsys.readouterr().out


def test_flops_budget_and_dense_depths_match_what_they_promise(tiny_data, tmp_path):
    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32,
              "model": {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 128}}
    plan = plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("flops=2e10"),
                        ["hydra", "vanilla", "dense", "dense-flops"], [], 4, shared)
    runs = {r.variant.name: r for r in plan.runs}
    for run in runs.values():  # the fewest steps whose executed FLOPs reach the budget
        steps = run.values["max_steps"]
        assert planned_flops(run.model_cfg, plan.base, steps, 128) >= 2e10
        assert planned_flops(run.model_cfg, plan.base, steps - 1, 128) < 2e10
    assert runs["hydra"].values["max_steps"] > runs["vanilla"].values["max_steps"]  # routing skips work
    hydra = runs["hydra"].model_cfg
    for name, measure in (("dense", parameter_count),
                          ("dense-flops", lambda cfg: executed_flops_per_token(cfg, 32, training=True))):
        dense = runs[name].model_cfg
        assert dense.arch == "dense"
        off = lambda n, measure=measure, dense=dense: abs(measure(dense.replace(n_layers=n)) - measure(hydra))  # noqa: E731
        assert off(dense.n_layers) <= min(off(n) for n in (dense.n_layers - 1, dense.n_layers + 1) if n >= 1)


def test_dataset_names_the_data_as_in_train(tiny_data, tmp_path):
    """``--dataset DIR`` (or 'default') instead of ``--data``, as ``hydra-lm train`` takes it; no run gets both."""
    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32, "dataset": str(tiny_data),
              "model": {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 128}}
    plan = plan_compare(None, str(tmp_path / "cmp"), parse_budget("tokens=1k"), ["hydra"], [], 1, shared)
    assert plan.runs[0].values["data"] == str(tiny_data) and "dataset" not in plan.runs[0].values


@pytest.mark.parametrize("budget", ["tokens=1280", "flops=2e10", "seconds=60"])
def test_a_variants_budget_scale_trains_it_for_that_share_of_the_budget(tiny_data, tmp_path, budget):
    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32,
              "model": {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 128}}
    plan = plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget(budget), ["hydra"],
                        ["h07:budget_scale=0.7", "d3:arch=dense,n_layers=3,budget_scale=0.5"], 4, shared)
    full, h07, d3 = plan.runs
    assert (h07.model_cfg, h07.variant.budget_scale, d3.model_cfg.n_layers) == (full.model_cfg, 0.7, 3)
    if budget.startswith("seconds"):  # the schedule runs to 70% of the seconds
        assert (h07.values["time_budget_s"], d3.values["time_budget_s"]) == (pytest.approx(42), pytest.approx(30))
        assert h07.values["max_steps"] == full.values["max_steps"]
    elif budget.startswith("tokens"):  # 10 steps of 128 tokens; 70% of them, rounded up
        assert (full.values["max_steps"], h07.values["max_steps"]) == (10, 7)
    else:  # the fewest steps whose executed FLOPs reach 70% of the budget
        steps = h07.values["max_steps"]
        assert planned_flops(h07.model_cfg, plan.base, steps, 128) >= 0.7 * 2e10
        assert planned_flops(h07.model_cfg, plan.base, steps - 1, 128) < 0.7 * 2e10 < 2e10
    with pytest.raises(ValueError, match="budget_scale=0 must be a number in"):
        parse_custom_variant("z:budget_scale=0")
    from hydra_lm.diagnostics.report import _own_budgets  # the report's header names them
    variants = {f"h07.seed{s}": {"variant": "h07", "budget_scale": 0.7} for s in (0, 1)}
    variants["hydra"] = {"variant": "hydra", "budget_scale": 1.0}
    assert _own_budgets({"variants": variants}) == " A share of the budget of their own: h07 x0.7."


def test_custom_variant_sets_the_routing_curriculum_and_its_flops(tiny_data, tmp_path):
    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32,
              "model": {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 128}}
    late = "late:mor_enable_pct=0.3,mod_enable_pct=0.1,mod_force_enable_pct=0.15,mor_gate_scale=0.2"
    plan = plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("flops=2e10"), ["hydra"], [late], 4,
                        shared)
    hydra, late = plan.runs
    assert late.values["mor_enable_pct"] == 0.3 and late.values["mod_force_enable_pct"] == 0.15
    assert late.model_cfg.mor_gate_scale == 0.2 and "mor_enable_pct" not in hydra.values
    # The same model starting dense is dearer per step, so the same FLOPs buy fewer steps.
    assert late.values["max_steps"] < hydra.values["max_steps"]
    train = plan.base.replace(mor_enable_pct=0.3, mod_enable_pct=0.1, mod_force_enable_pct=0.15)
    assert planned_flops(late.model_cfg, train, late.values["max_steps"], 128) >= 2e10
    assert planned_flops(late.model_cfg, train, late.values["max_steps"] - 1, 128) < 2e10
    with pytest.raises(ValueError, match="curriculum settings"):
        parse_custom_variant("bad:mor_enable=0.1")


@pytest.mark.parametrize("tokens, evals, due", [(1280, 3, [4, 8, 10]), (1024, 2, [4, 8]),
                                               (1280, 20, list(range(1, 11)))])
def test_evaluations_are_spread_over_the_budget_without_a_repeat_at_the_end(tiny_data, tmp_path, tokens, evals, due):
    """``--evals N``: N evaluations after the start, the last at the run's end; with a step count that N
    does not divide, none falls one step before the end (where the trainer evaluates again)."""
    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32, "eval_at_start": False}
    plan = plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget(f"tokens={tokens}"), ["hydra"], [],
                        evals, shared)
    values = plan.runs[0].values
    cfg = SimpleNamespace(eval_every=values["eval_every"], max_steps=values["max_steps"], log_every=1, save_every=100)
    steps = values["max_steps"]
    evaluated = [s for s in range(1, steps + 1) if due_after_step(cfg, s, s - 1, s, steps, False).eval]
    assert evaluated == due


def test_custom_variant_compares_optimizers_at_one_batch_with_their_own_learning_rates(tiny_data, tmp_path):
    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32,
              "model": {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 128}}
    plan = plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("tokens=1024"), [],
                        ["adamw:optimizer=adamw", "lion:optimizer=lion", "muon:optimizer=muon,adamw_lr=0.003",
                         "slow:lr=1e-4"], 2, shared)
    runs = {r.variant.name: r.values for r in plan.runs}
    adamw, lion, muon, slow = runs["adamw"], runs["lion"], runs["muon"], runs["slow"]
    assert {v["batch_size"] for v in runs.values()} == {4} and {v["max_steps"] for v in runs.values()} == {8}
    assert lion["optimizer"] == "lion" and lion["lr"] == pytest.approx(OPTIMIZER_LR_SCALE["lion"] * adamw["lr"])
    assert lion["min_lr"] == pytest.approx(lion["lr"] / 10)  # the schedule follows the optimizer's own LR
    assert muon["optimizer"] == "muon" and muon["adamw_lr"] == 0.003 and "optimizer" not in slow
    assert slow["lr"] == 1e-4 and slow["min_lr"] == pytest.approx(1e-5)
    assert all(r.model_cfg == plan.runs[0].model_cfg for r in plan.runs)  # one model, four trainings
    with pytest.raises(ValueError, match="optimizer settings"):
        parse_custom_variant("bad:optimiser=lion")
    # Trainer settings are checked as their flags are: one line naming the value and what it must be.
    for spec, message in (("bad:optimizer=adamm", "optimizer='adamm' must be one of"),
                          ("bad:lr=abc", "lr='abc' must be of type float"),
                          ("bad:fp8_format=e9", "fp8_format='e9' must be one of")):
        with pytest.raises(ValueError, match=f"--variant bad: {message}"):
            parse_custom_variant(spec)
    # Precision is a trainer setting too: the model stays the same, the run converts its matmuls.
    fp8 = parse_custom_variant("fp8:experimental_fp8=true,fp8_format=e5m2")
    assert fp8.train == {"experimental_fp8": True, "fp8_format": "e5m2"} and fp8.overrides == {}
    # The report names the variants whose optimizer or learning rate is not the shared one.
    shared_lr = plan.base.lr
    results = {"settings": {"optimizer": "adamw", "lr": shared_lr, "min_lr": shared_lr / 10},
               "variants": {name: {"optimizer": v.get("optimizer", "adamw"), "lr": v["lr"], "min_lr": v["min_lr"]}
                            for name, v in runs.items()}}
    line = _own_optimizers(results)
    assert "lion: lion" in line and "muon: muon" in line and "slow: adamw, 0.0001 -> 1e-05" in line
    assert "adamw:" not in line


def test_seconds_budget_runs_on_different_devices_are_flagged(tiny_data, tmp_path, capsys):
    """A training-time budget buys different work on an H100 and an H200: the report says so (and `scaling`
    keeps such runs apart, tests/test_scaling.py)."""
    from hydra_lm.diagnostics.compare_results import run_device

    out = tmp_path / "cmp"
    assert compare(tiny_data, out, "--budget", "seconds=1", "--variants", "hydra", "--seeds", "0", "1",
                   "--evals", "1") == 0
    results = json.loads((out / "results.json").read_text())
    assert not any("different devices" in w for w in results["warnings"])
    config = out / "runs" / "hydra.seed1" / "config.json"  # as if seed 1 had run on another machine
    record = json.loads(config.read_text())
    on_gpu = {**record, "train": {**record["train"], "device": "cuda"},
              "versions": {**record["versions"], "gpu": "NVIDIA H200"}}
    config.write_text(json.dumps(on_gpu))
    capsys.readouterr()
    assert compare(tiny_data, out, "--budget", "seconds=1", "--variants", "hydra", "--seeds", "0", "1",
                   "--evals", "1") == 0
    results = json.loads((out / "results.json").read_text())
    assert [v["device"] for v in results["variants"].values()] == ["cpu", "NVIDIA H200"]
    warning = next(w for w in results["warnings"] if "different devices" in w)
    assert "NVIDIA H200: hydra.seed1" in warning and "cpu: hydra.seed0" in warning
    assert warning in (out / "report.md").read_text()
    config.write_text(json.dumps({**on_gpu, "train": {**record["train"], "device": "cpu"}}))
    assert run_device(config.parent) == "cpu"  # --device cpu on a GPU host


def test_time_budget_stops_on_training_time_and_resumes_it(tiny_data, tmp_path, capsys):
    run, budget = tmp_path / "run", 3.0
    args = ["train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--time_budget_s", str(budget),
            "--max_steps", "1000", "--log_every", "1", "--eval_every", "0", "--save_every", "1000",
            "--no-eval_at_start"]
    assert main(args) == 0
    train_rs = records(run, "train")
    times = [r["train_s"] for r in train_rs]
    assert times == sorted(times) and train_rs[-1]["step"] < 1000
    # It stops at the first step that reaches the budget (a record's time is read just after the
    # step's own check, hence the small allowance on the one before).
    assert times[-1] >= budget and (len(times) < 2 or times[-2] < budget + 0.1)  # one slow step on a busy machine
    final_eval = records(run, "eval")[-1]
    assert final_eval["step"] == train_rs[-1]["step"] and times[-1] <= final_eval["train_s"] < times[-1] + 0.5
    # The schedule follows the fraction of the budget spent, in thousandths here (max_steps 1000): a
    # step's learning rate is the schedule's at some point between the previous record and its own.
    cfg = json.loads((run / "config.json").read_text())["train"]
    for previous, r in zip(train_rs, train_rs[1:]):
        span = range(int(1000 * previous["train_s"] / budget), min(1000, int(1000 * r["train_s"] / budget)) + 1)
        lrs = [lr_at(k, lr=cfg["lr"], min_lr=cfg["min_lr"], warmup_steps=cfg["warmup_steps"], max_steps=1000,
                     schedule=cfg["schedule"], wsd_decay_pct=cfg["wsd_decay_pct"]) for k in span]
        assert min(lrs) - 1e-12 <= r["lr"] <= max(lrs) + 1e-12
    capsys.readouterr()
    assert main(["train", "--out", str(run)]) == 0  # the spent time came back with the checkpoint
    assert "nothing to do" in capsys.readouterr().out
    assert len(records(run, "train")) == len(train_rs)


def test_the_report_reads_off_the_time_and_compute_a_routed_variant_took_to_reach_each_dense_loss():
    from hydra_lm.diagnostics.report import first_reach, reach_rows

    def run(arch, points, seed=0):
        evals = [{"train_s": t, "flops": 10.0 * t, "val_loss_causal": loss} for t, loss in points]
        return {"arch": arch, "status": "finished", "seed": seed, "evals": evals, "train_s": points[-1][0],
                "executed_flops": 10.0 * points[-1][0], "final": {"val_loss_causal": points[-1][1]}}
    evals = run("hydra", [(0, 9.0), (60, 1.8), (120, 1.5)])["evals"]
    assert first_reach(evals, "train_s", 1.6) == (pytest.approx(60 + (1.8 - 1.6) / (1.8 - 1.5) * 60), False)  # 100 s
    assert first_reach(evals, "train_s", 9.5) == (0, False) and first_reach(evals, "train_s", 1.4) is None
    # Without an evaluation at the start, one at the end only bounds when the loss was reached.
    assert first_reach(evals[1:], "train_s", 2.0) == (60, True)
    results = {"variants": {"hydra": run("hydra", [(0, 9.0), (60, 1.8), (120, 1.5)]),
                            "slow": run("hydra", [(0, 9.0), (60, 2.5), (120, 2.0)]),
                            "dense": run("dense", [(0, 9.0), (60, 2.0), (120, 1.6)]),
                            "dense.seed1": run("dense", [(0, 9.0), (120, 1.0)], seed=1),
                            "once": run("hydra", [(120, 1.2)])}}
    rows = reach_rows(results)  # routed variants against the dense runs of their own seed only
    assert rows == [("hydra", "dense", "1.6000", "100.0", "0.83", "1e+03", "0.83"),
                    ("slow", "dense", "1.6000", "not reached", "-", "not reached", "-"),
                    ("once", "dense", "1.6000", "<= 120.0", "<= 1.00", "<= 1.2e+03", "<= 1.00")]


def test_a_run_whose_throughput_wavered_is_flagged_as_unfair_to_a_seconds_budget():
    from hydra_lm.diagnostics.compare_results import STEADY_THROUGHPUT, throughput_steadiness, unsteady_warning

    def records(tps):  # two start-up windows (compilation, capture) the measure leaves out
        return [{"tokens_per_s": 1_000.0}, {"tokens_per_s": 50_000.0}] + [{"tokens_per_s": t} for t in tps]
    rng = np.random.default_rng(0)
    steady = throughput_steadiness(records(760_000 * (1 + 0.01 * rng.standard_normal(200))))
    # Windows that lost the host's CPUs to another job's compilation now and then.
    wavering = throughput_steadiness(records(np.where(rng.random(200) < 0.3, 560_000, 850_000)))
    assert steady > 0.95 and wavering == pytest.approx(560_000 / 850_000)
    assert unsteady_warning("d6", steady) == []
    (line,) = unsteady_warning("b8r1.seed0", wavering)
    assert line.startswith("b8r1.seed0: its throughput was unsteady") and f"{STEADY_THROUGHPUT:.0%}" in line
    assert throughput_steadiness(records([800_000.0] * 9)) is None  # too few windows to tell



def test_a_seconds_budget_takes_time_units_and_tokens_and_flops_magnitudes():
    assert [parse_budget(f"seconds={t}").value for t in ("10m", "1.5h", "90s", "600")] == [600, 5400, 90, 600]
    assert [parse_budget(b).value for b in ("tokens=2M", "flops=1.5k", "flops=5e15")] == [2e6, 1500, 5e15]


def test_eval_every_0_evaluates_at_the_start_and_the_end_only(tiny_data, tmp_path):
    from hydra_lm.diagnostics.compare_results import collect_results
    from hydra_lm.diagnostics.report import write_report

    shared = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32, "eval_every": 0}
    with pytest.raises(ValueError, match="--evals and --eval_every both set"):
        plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("tokens=8k"), ["hydra"], [], 2, shared)
    plan = plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("tokens=8k"), ["hydra"], [], None, shared)
    assert plan.runs[0].values["eval_every"] == 0 and plan.evals is None
    write_report(collect_results(plan), [], tmp_path / "report.md")
    assert "measured at the start and at the end only (--eval_every 0)" in (tmp_path / "report.md").read_text()


def test_a_variant_that_raises_is_reported_failed_and_the_others_train(tiny_data, tmp_path, monkeypatch, capsys):
    import hydra_lm.train as train_module

    train = train_module.train

    def out_of_memory_in_bad(setup):
        if setup.run_dir.name == "bad":
            setup.close()  # as train does on its way out
            raise RuntimeError("CUDA out of memory (simulated)")
        return train(setup)
    monkeypatch.setattr(train_module, "train", out_of_memory_in_bad)
    out = tmp_path / "cmp"
    request = ("--budget", "tokens=256", "--variant", "bad:mod_capacity=0.5", "--variant", "after:mod_capacity=0.25",
               "--evals", "1")
    assert compare(tiny_data, out, *request) == 1
    printed = capsys.readouterr()
    assert "RuntimeError: CUDA out of memory (simulated)" in printed.err
    assert "bad failed (traceback above)" in printed.out
    results = json.loads((out / "results.json").read_text())
    assert {name: v["status"] for name, v in results["variants"].items()} == {"bad": "failed", "after": "finished"}
    assert "| bad (failed) |" in (out / "report.md").read_text()
    monkeypatch.setattr(train_module, "train", train)
    assert compare(tiny_data, out, *request) == 0  # the same command trains the failed run again
    assert "after (2/2) finished earlier" in capsys.readouterr().out


@pytest.mark.parametrize("causal", [None, 4.2])
def test_a_non_finite_final_loss_is_the_runs_final_one_and_warned_about_by_the_runs_name(tmp_path, causal):
    """MetricsWriter stores a non-finite loss as null: the run ends on that evaluation, not on its last finite one,
    and its warnings name the run (a variant's seed or learning rate), not the variant."""
    from hydra_lm.config import preset_config
    from hydra_lm.diagnostics.compare_results import variant_results
    from hydra_lm.diagnostics.compare_runs import VariantRun, write_marker
    from hydra_lm.diagnostics.report import table_rows
    from hydra_lm.diagnostics.variants import Variant

    run_dir = tmp_path / "runs" / "hydra.seed1"
    run_dir.mkdir(parents=True)
    router = {"target": 0.125, "exec_causal": 0.5, "exec_topk": 0.125, "agreement": 0.9, "active": True,
              "calibrated": True}
    rs = [{"kind": "eval", "step": 0, "val_loss_causal": 5.6, "val_loss_topk": 5.6, "val_gap": 0.0},
          *({"kind": "train", "step": s, "train_s": 0.1 * s} for s in (4, 8)),
          {"kind": "eval", "step": 8, "val_loss_causal": causal, "val_loss_topk": None, "val_gap": None,
           "routing": {"block1.mod0": router}}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    run = VariantRun(Variant("hydra"), run_dir, {"lr": 1e-3, "min_lr": 1e-4, "max_steps": 8, "seed": 1},
                     preset_config("debug", arch="dense"), "hydra.seed1", 1)
    write_marker(run, "finished")
    entry = variant_results(run, 32, 128, tmp_path)
    assert entry["final"]["step"] == 8 and entry["final"]["val_loss_causal"] == causal
    assert [p["val_loss_causal"] for p in entry["evals"]] == [5.6, causal]
    lost = "causal and top-k" if causal is None else "top-k"
    assert entry["warnings"] == [
        "hydra.seed1: router block1.mod0 executes 4.00x its target under causal routing (0.5000 of the tokens against "
        "0.1250): generation runs more of that unit than training did",
        f"hydra.seed1: its final evaluation (step 8) has a non-finite {lost} validation loss, reported as such: the "
        "model diverged by then (lower the learning rate, or look for the step where its training loss left the "
        "finite numbers)"]
    (row,) = table_rows({"variants": {run.name: entry}})
    assert row[6:9] == ("nan" if causal is None else "4.2000", "nan", "nan")

"""Pretests of the enabled optimizations against the plain path before training: history, a broken
optimization switched off while the run goes on, skipping, and re-running on a resume."""

import contextlib
import json
import math
import time

import pytest
import torch

import hydra_lm.model.hydra as hydra_module
from hydra_lm.cli import main
from hydra_lm.infer.runs import export_model
from hydra_lm.train import get_history, get_summary, print_summary, run_pretests_for_checkpoint
from hydra_lm.train.compile_policy import compile_units
from hydra_lm.train.step import TrainStep
from support import TINY_RUN, records

RUN = [*TINY_RUN, "--max_steps", "3", "--save_every", "3", "--log_every", "1", "--eval_every", "0",
       "--no-eval_at_start", "--warmup_steps", "1"]
CHUNKED = "the fused chunked loss (--chunked_ce)"


def train(data, run, *extra):
    return main(["train", "--data", str(data), "--out", str(run), *RUN, *extra])


def test_a_correct_optimization_passes_and_is_recorded(tiny_data, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--chunked_ce") == 0
    [entry] = get_history(run)
    assert entry["trigger"] == "new run" and entry["flags"]["chunked_ce"] is True
    [result] = entry["results"]
    assert result["optimization"] == "chunked_ce" and result["passed"], result
    assert result["loss_diff"] < 1e-4 and result["grad_diff"] < 1e-3
    [own_file] = (run / "pretest_logs").glob("pretest_2*.json")  # named by the time; the history is beside it
    assert json.loads(own_file.read_text()) == entry
    assert "pretest passed for --chunked_ce (new run)" in capsys.readouterr().out
    summary = get_summary(run)
    assert summary["pretests"] == 1 and summary["optimizations"]["chunked_ce"]["passed"] == 1
    print_summary(run)
    assert "--chunked_ce: passed 1, failed 0; last passed" in capsys.readouterr().out
    assert records(run, "safety") == []
    # Pretesting a checkpoint of the run appends to the same history.
    checked = run_pretests_for_checkpoint(run / "checkpoints" / "hydra_debug_step3")
    assert checked["trigger"] == "checkpoint load" and checked["results"][0]["passed"]
    assert len(get_history(run)) == 2
    # A relative path (here from inside checkpoints/) still records in the run, not in checkpoints/pretest_logs.
    monkeypatch.chdir(run / "checkpoints")
    run_pretests_for_checkpoint("hydra_debug_step3")
    assert len(get_history(run)) == 3 and not (run / "checkpoints" / "pretest_logs").exists()
    # An exported file records beside itself: it has no run directory.
    exported = export_model(run, tmp_path / "shipped" / "model.safetensors")
    assert run_pretests_for_checkpoint(exported)["results"][0]["passed"]
    assert len(get_history(tmp_path / "shipped")) == 1 and len(get_history(run)) == 3


def wrong(real, monkeypatch):
    return lambda *a, **kw: real(*a, **kw) * 1.5


def slow(real, monkeypatch):
    """Each fused loss costs 10 s on the pretest's clock: a machine's load cannot hide it."""
    import hydra_lm.train.pretest as pretest

    lost = [0.0]
    monkeypatch.setattr(pretest.time, "perf_counter", lambda clock=time.perf_counter: clock() + lost[0])

    def loss(*a, **kw):
        lost[0] += 10.0
        return real(*a, **kw)

    return loss


def crash(real, monkeypatch):
    def loss(*a, **kw):
        raise RuntimeError("fused kernel exploded")

    return loss


@pytest.mark.parametrize("break_it,complaint", [(wrong, "loss "), (slow, "a step takes "),
                                                (crash, "raised RuntimeError: fused kernel exploded")])
def test_a_broken_fused_loss_is_switched_off_and_training_goes_on(tiny_data, tmp_path, monkeypatch, capsys,
                                                                    break_it, complaint):
    monkeypatch.setattr(hydra_module, "linear_cross_entropy", break_it(hydra_module.linear_cross_entropy, monkeypatch))
    original, used = TrainStep.micro_step, []

    def micro_step(self, *args, **kwargs):
        used.append(self.model.ce_impl)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "micro_step", micro_step)
    run = tmp_path / "run"
    assert train(tiny_data, run, "--chunked_ce") == 0
    err = capsys.readouterr().err
    assert f"pretest failed for {CHUNKED}: {complaint}" in err
    assert used == ["naive"] * 3  # every step on the plain loss
    [off] = records(run, "safety")
    assert (off["action"], off["optimization"]) == ("off", CHUNKED)
    assert off["reason"].startswith(f"pretest: {complaint}")
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records(run, "train"))
    assert get_summary(run)["optimizations"]["chunked_ce"]["failed"] == 1


def test_a_plain_path_out_of_memory_skips_the_pretest_and_the_run_goes_on(tiny_data, tmp_path, monkeypatch, capsys):
    """The plain path materialises the whole logits: where it runs out of memory there is nothing to compare with,
    which is no failure of the optimization. It runs on at most PRETEST_ROWS of the run's rows."""
    from hydra_lm.train import pretest

    step, rows = pretest._Path.step, []

    def plain_out_of_memory(self, batch, autocast, timed):
        rows.append(batch[0].shape[0])
        if self.ce_impl == "naive":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")
        return step(self, batch, autocast, timed)

    monkeypatch.setattr(pretest._Path, "step", plain_out_of_memory)
    run = tmp_path / "run"
    assert train(tiny_data, run, "--chunked_ce", "--batch_size", "8") == 0
    assert rows == [pretest.PRETEST_ROWS] == [4]  # of the run's 8
    [result] = get_history(run)[0]["results"]
    reason = "the plain path raised OutOfMemoryError: CUDA out of memory. Tried to allocate 24.00 GiB"
    assert result == {"optimization": "chunked_ce", "passed": None, "skipped": True, "reason": reason}
    assert "pretest skipped for --chunked_ce (new run): the plain path raised OutOfMemoryError" in \
        capsys.readouterr().err
    assert records(run, "safety") == []  # the fused loss stays on
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3]
    assert get_summary(run)["optimizations"]["chunked_ce"]["skipped"] == 1
    print_summary(run)
    assert "--chunked_ce: passed 0, failed 0, skipped 1; last skipped (the plain path raised" in \
        capsys.readouterr().out


def test_the_pretest_batch_keeps_a_few_rows_that_the_row_groups_split():
    from hydra_lm.train.pretest import pretest_batch

    cpu = torch.device("cpu")
    for batch_size, groups, rows in ((64, 1, 4), (2, 1, 2), (12, 3, 3), (16, 8, 8), (8, 2, 4)):
        inputs, targets = pretest_batch(97, batch_size, 16, cpu, seed=0, topk_groups=groups)
        assert inputs.shape == targets.shape == (rows, 16)


def test_skip_pretest_flag(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--chunked_ce", "--experimental_skip_pretest") == 0
    assert "--experimental_skip_pretest: not pretesting --chunked_ce" in capsys.readouterr().out
    assert not (run / "pretest_logs").exists()


def test_a_resume_with_a_changed_flag_pretests_again(tiny_data, tmp_path):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "6", "--stop_at_step", "2", "--save_every", "2") == 0
    assert get_history(run) == []  # nothing enabled, nothing to pretest
    assert train(tiny_data, run, "--max_steps", "6", "--stop_at_step", "4", "--save_every", "2", "--chunked_ce") == 0
    assert train(tiny_data, run, "--max_steps", "6", "--save_every", "2") == 0  # --chunked_ce comes from config.json
    history = get_history(run)
    assert [(e["trigger"], e["step"]) for e in history] == [
        ("optimization flags changed (chunked_ce: auto -> True)", 2), ("checkpoint load", 4)]
    assert all(e["results"][0]["passed"] for e in history)


def test_a_checkpoint_pretests_what_its_run_turned_on_including_the_automatic_defaults():
    from hydra_lm.train.pretest import pretested_on

    automatic = {"compile": None, "chunked_ce": None}  # how a default run saves them
    assert pretested_on(automatic, "cuda") == ["compile", "chunked_ce"] and pretested_on(automatic, "cpu") == []
    assert pretested_on({"compile": False, "chunked_ce": True}, "cuda") == ["chunked_ce"]


def test_the_trigger_names_what_changed_since_the_checkpoint():
    from hydra_lm.train.pretest import trigger_of

    saved = {"model_size": "debug", "train_config": {"chunked_ce": True, "compile": False}}
    assert trigger_of({"chunked_ce": True}, "debug", None) == "new run"
    assert trigger_of({"chunked_ce": True, "compile": False}, "debug", saved) == "checkpoint load"
    assert trigger_of({"chunked_ce": True, "compile": True}, "debug", saved) == \
        "optimization flags changed (compile: False -> True)"
    assert trigger_of({"chunked_ce": True}, "100M", saved) == "model size changed (debug -> 100M)"
    # a checkpoint of a run saved with a removed flag (--compile_mode) resumes without a pretest of its own
    removed = {"model_size": "debug", "train_config": {"chunked_ce": True, "compile": False, "compile_mode": "default"}}
    assert trigger_of({"chunked_ce": True, "compile": False}, "debug", removed) == "checkpoint load"


def test_the_pretest_copy_runs_its_units_eagerly_and_leaves_the_runs_compiled_units(monkeypatch):
    from hydra_lm.train import pretest
    from support import tiny_model

    model = compile_units(tiny_model(), backend="eager")
    copies, real_init = [], pretest._Path.__init__

    def init(self, model, *args, **kwargs):
        copies.append(model)
        real_init(self, model, *args, **kwargs)

    monkeypatch.setattr(pretest._Path, "__init__", init)
    batch = pretest.pretest_batch(97, 2, 16, torch.device("cpu"), seed=0)
    result = pretest.compare("chunked_ce", model, batch, contextlib.nullcontext, "cpu", ce_impl="chunked")
    assert result["passed"], result
    assert all(b.compiled_unit is not None for b in model.blocks)  # the run keeps its compiled units
    assert all(b.compiled_unit is None for b in copies[0].blocks)  # no second compilation for the copy

"""Run safety under injected faults: divergence (NaN gradients), the run-directory lock, quarantined
checkpoints, and one-line errors for bad input and a full disk."""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hydra_lm.cli import main
from hydra_lm.train.checkpoint import verify
from hydra_lm.train.trainer import Trainer
from hydra_lm.train.step import TrainStep
from support import TINY_RUN, records, rewrite_state, tiny_model

# Saves every 3 steps, logs every 5: a checkpoint falls between log points.
FAST = [*TINY_RUN, "--max_steps", "12", "--save_every", "3", "--log_every", "5", "--eval_every", "0",
        "--eval_batches", "1", "--no-eval_at_start", "--keep_checkpoints", "1", "--lr", "1e-3", "--warmup_steps", "1"]


def train(data, run, *extra):
    return main(["train", "--data", str(data), "--out", str(run), *FAST, *extra])


def trainer_step_in_progress(monkeypatch) -> list[int]:
    """A one-element list holding the 0-based index of the trainer's step being run."""
    current = [0]
    original = Trainer._train_step

    def train_step(self, window):
        current[0] = self.step
        return original(self, window)

    monkeypatch.setattr(Trainer, "_train_step", train_step)
    return current


def spike_logged_losses(monkeypatch, steps: set[int], path=lambda model: model.ce_impl) -> list[tuple[int, str]]:
    """The logged loss of the given 0-based steps is x1000 (the update itself is normal); returns the
    (1-based step, ``path(model)``: by default the loss path) of every micro-step run."""
    original, seen, pending = TrainStep.micro_step, [], set(steps)
    current = trainer_step_in_progress(monkeypatch)

    def micro_step(self, *args, **kwargs):
        step = current[0]
        seen.append((step + 1, path(self.model)))
        parts, stats = original(self, *args, **kwargs)
        if step in pending:
            pending.discard(step)
            parts = parts * 1000
        return parts, stats

    monkeypatch.setattr(TrainStep, "micro_step", micro_step)
    return seen


def poison_gradients(monkeypatch, steps):
    """NaN in one gradient at the given 0-based step indices (each index once, or every time if ``steps`` is a
    callable)."""
    original = TrainStep.update_step
    pending = set(steps) if not callable(steps) else None
    current = trainer_step_in_progress(monkeypatch)

    def update(self):
        step = current[0]
        hit = steps(step) if pending is None else step in pending
        if hit:
            if pending is not None:
                pending.discard(step)
            next(p for p in self.params if p.grad is not None).grad.fill_(float("nan"))
        return original(self)

    monkeypatch.setattr(TrainStep, "update_step", update)


def checkpoints(run):
    found = [p for p in (run / "checkpoints").glob("hydra_*_step*") if p.name.rsplit("step", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.rsplit("step", 1)[1]))


def weights_finite(ckpt_dir) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(str(ckpt_dir / "model.safetensors")).values())


def test_nan_gradient_rolls_back_to_the_last_good_checkpoint_with_a_lower_lr(tiny_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    poison_gradients(monkeypatch, {5})  # the update that ends step 6, a save point
    assert train(tiny_data, run) == 0
    [event] = records(run, "divergence")
    assert event["action"] == "rollback" and event["to_step"] == 3 and event["lr_scale"] == 0.5
    assert event["rollbacks"] == 1  # this rollback counted, as the log's "rollback 1 of 2"
    log = (run / "train.log").read_text()
    assert "rolled back to" in log and "resumed from" not in log  # a rollback within the run, not a restart
    train_records = records(run, "train")
    # Steps 4-5 ran again after the rollback: the record of the attempt rolled back is gone, the event stays.
    assert [r["step"] for r in train_records] == [5, 10, 12]
    assert all(math.isfinite(r["loss"]) for r in train_records)
    assert [r["lr"] for r in train_records[:2]] == pytest.approx([0.5e-3, 0.5e-3])  # stable phase, halved
    [last] = checkpoints(run)
    assert last.name.endswith("step12") and weights_finite(last)
    assert verify(last).state["rollback"] == {"rollbacks": 1, "lr_scale": 0.5}


def test_persistent_divergence_stops_naming_a_good_checkpoint_and_keeps_it(tiny_data, tmp_path, monkeypatch,
                                                                            capsys):
    run = tmp_path / "run"
    poison_gradients(monkeypatch, lambda step: step >= 5)
    assert train(tiny_data, run) == 1
    [good] = checkpoints(run)
    assert good.name.endswith("step3") and weights_finite(good)  # never rotated away by a NaN state
    actions = [r["action"] for r in records(run, "divergence")]
    assert actions == ["rollback", "rollback", "stop"]
    err = capsys.readouterr().err
    assert f"last good checkpoint is {good} (step 3)" in err and "--lr 0.000125" in err and "--adamw_lr" not in err
    # With Muon and an absolute --adamw_lr, the advice lowers that part too.
    muon = tmp_path / "muon"
    assert train(tiny_data, muon, "--optimizer", "muon", "--adamw_lr", "2e-3") == 1
    assert "--lr 0.000125 --adamw_lr 0.00025" in capsys.readouterr().err


def test_a_stop_asked_for_at_a_divergence_explains_it_and_names_the_good_checkpoint(tiny_data, tmp_path, monkeypatch,
                                                                                     capsys):
    run = tmp_path / "run"
    poison_gradients(monkeypatch, {5})  # found at step 6's save, when the stop arrives: no rollback, but said why
    monkeypatch.setattr(Trainer, "_stop_agreed", lambda self: self.step >= 6)
    assert train(tiny_data, run) == 1
    assert [r["action"] for r in records(run, "divergence")] == ["stop"]
    err = capsys.readouterr().err
    assert "as the run was asked to stop, without a rollback" in err and "(step 3)" in err


def test_resuming_with_the_advised_lr_runs_at_that_lr(tiny_data, tmp_path, monkeypatch, capsys):
    """The advice folds the rollbacks' scaling into its --lr: the resumed run must not scale it again."""
    run = tmp_path / "run"
    poison_gradients(monkeypatch, {5, 8})  # a rollback to step 3 (LR x0.5), then a stop after the step-6 save
    assert train(tiny_data, run, "--max_rollbacks", "1") == 1
    assert [r["action"] for r in records(run, "divergence")] == ["rollback", "stop"]
    assert verify(checkpoints(run)[-1]).state["rollback"] == {"rollbacks": 1, "lr_scale": 0.5}
    assert "--lr 0.00025" in capsys.readouterr().err
    monkeypatch.undo()
    assert train(tiny_data, run, "--lr", "0.00025") == 0
    assert records(run, "train")[-2]["step"] == 10 and records(run, "train")[-2]["lr"] == pytest.approx(2.5e-4)
    # the divergence that stopped the run stays beside the resumed steps: it explains their lower learning rate
    assert [r["action"] for r in records(run, "divergence")] == ["rollback", "stop"]


def test_repeated_divergences_add_up_to_switching_an_optimization_off(tiny_data, tmp_path, monkeypatch):
    # Each rollback forgets the anomalies after the checkpoint it returns to, but not the divergence behind it.
    run = tmp_path / "run"
    poison_gradients(monkeypatch, lambda step: step >= 5)
    assert train(tiny_data, run, "--chunked_ce", "--max_rollbacks", "3") == 1
    assert [r["action"] for r in records(run, "divergence")] == ["rollback"] * 3 + ["stop"]
    assert [(r["step"], r["action"], r["optimization"]) for r in records(run, "safety")] == [
        (3, "off", "the fused chunked loss (--chunked_ce)")]


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_non_finite_or_negative_lr_is_refused(tiny_data, tmp_path, capsys, value):
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "run"), *TINY_RUN, "--lr", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hydra-lm train: error: lr=") and "\n" not in err


def test_a_second_trainer_on_the_same_directory_is_refused_until_the_first_dies(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hydra_lm", "train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN,
           "--max_steps", "100000", "--save_every", "100000", "--log_every", "1", "--eval_every", "0",
           "--no-eval_at_start"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for_training(first, run, 120)
        in_progress = run / "checkpoints" / ".tmp-hydra_debug_step100000-4242"  # the first trainer's half-written save
        in_progress.mkdir(parents=True)
        assert train(tiny_data, run, "--max_steps", "2") == 2
        err = capsys.readouterr().err.strip()
        assert f"is in use by another trainer (pid {first.pid} on host " in err and "\n" not in err
        assert in_progress.is_dir()
    finally:
        first.kill()
        first.wait()
    # SIGKILL leaves the lock file behind, but not the lock: the next trainer takes it over.
    assert train(tiny_data, run, "--max_steps", "2", "--save_every", "2") == 0
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()


def test_all_checkpoints_corrupt_needs_restart_to_start_over(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "3") == 0
    [ckpt] = checkpoints(run)
    model_file = ckpt / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])
    for attempt in range(2):  # the first attempt quarantines it; a later one must not quietly start over either
        capsys.readouterr()
        assert train(tiny_data, run, "--max_steps", "6") == 2
        err = capsys.readouterr().err
        assert "Pass --restart to start this run again from step 0" in err
        assert ("no earlier checkpoint is left" in err) == (attempt == 0) and "falling back" not in err
        assert not (run / "checkpoints" / "hydra_debug_step6").exists()
    assert (run / "checkpoints" / f"{ckpt.name}.corrupt").is_dir()
    assert train(tiny_data, run, "--max_steps", "6", "--restart") == 0
    assert "--restart: starting over from step 0" in capsys.readouterr().err
    assert [p.name for p in checkpoints(run)] == ["hydra_debug_step6"]
    assert (run / "checkpoints" / f"{ckpt.name}.corrupt").is_dir()


@pytest.mark.parametrize("attempts_before", [0, 1])
def test_restart_starts_over_with_the_runs_own_config(tiny_data, tmp_path, capsys, attempts_before):
    """--restart works the first time it is given (before any start has set the checkpoints aside) and later, and
    the run trains again with its saved settings, not the defaults."""
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "3", "--beta2", "0.97") == 0
    [ckpt] = checkpoints(run)
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:100])
    for _ in range(attempts_before):
        assert train(tiny_data, run, "--max_steps", "6") == 2
    capsys.readouterr()
    assert train(tiny_data, run, "--max_steps", "6", "--restart") == 0
    err = capsys.readouterr().err
    assert "--restart: starting over from step 0" in err and "no usable checkpoint" not in err
    assert [p.name for p in checkpoints(run)] == ["hydra_debug_step6"]
    assert json.loads((run / "config.json").read_text())["train"]["beta2"] == 0.97


def test_corrupt_config_json_advice_works(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "6", "--stop_at_step", "3") == 0
    (run / "config.json").write_text("{not json")
    capsys.readouterr()
    assert train(tiny_data, run, "--max_steps", "6") == 2
    err = capsys.readouterr().err.strip()
    assert "config.json is corrupt" in err and "move it away" in err and "\n" not in err
    (run / "config.json").rename(run / "config.json.bad")  # what the message says to do
    assert train(tiny_data, run, "--max_steps", "6") == 0
    assert "resumed from" in capsys.readouterr().out
    assert [p.name for p in checkpoints(run)] == ["hydra_debug_step6"]


@pytest.fixture(scope="module")
def finished_run(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    assert train(tiny_data, run, "--max_steps", "6", "--keep_checkpoints", "2") == 0
    return run


def test_eval_refuses_data_the_run_was_not_trained_on_or_says_how(tmp_path, capsys):
    """Another tokenizer's data gives losses that mean nothing; the run's own data prepared again (another split)
    may score documents it trained on: both are refused, the second unless --data names it on purpose."""
    from support import prepare, write_corpus

    data = prepare(write_corpus(tmp_path / "corpus"), tmp_path / "data")
    run = tmp_path / "run"
    assert train(data, run, "--max_steps", "3") == 0
    other = prepare(write_corpus(tmp_path / "other_corpus", seed=3), tmp_path / "other")
    assert main(["eval", "--run", str(run), "--data", str(other)]) == 2
    assert "was not tokenized like the data run" in one_line_error(capsys, "eval")
    assert main(["prepare", "--inputs", str(tmp_path / "corpus"), "--out", str(data), "--tokenizer",
                 str(run / "tokenizer.json"), "--val_fraction", "0.3", "--no_progress"]) == 0
    assert "warning: replacing the data prepared in" in capsys.readouterr().err  # prepare says so up front
    assert main(["eval", "--run", str(run)]) == 2
    assert "was prepared again since run" in one_line_error(capsys, "eval")
    assert main(["eval", "--run", str(run), "--data", str(data)]) == 0


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hydra-lm {command}: error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("where", ["cli", "config_file"])
@pytest.mark.parametrize("field,value,kind", [("n_blocks", "abc", "an integer"), ("mod_capacity", "[1]", "a number"),
                                              ("static_routing_mode", "3", "true or false")])
def test_wrong_typed_model_value_is_one_line(tiny_data, tmp_path, capsys, where, field, value, kind):
    if where == "cli":
        extra = [f"--model.{field}", value]
    else:
        toml_value = {"abc": '"abc"'}.get(value, value)
        (tmp_path / "cfg.toml").write_text(f"[model]\n{field} = {toml_value}\n")
        extra = ["--config", str(tmp_path / "cfg.toml")]
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "run"), *FAST, *extra]) == 2
    err = one_line_error(capsys, "train")
    assert f"HydraConfig.{field}=" in err and err.endswith(f"must be {kind}")


def test_bad_device_and_info_seq_len_are_one_line(tiny_data, tmp_path, capsys):
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "run"), *TINY_RUN, "--device",
                 "foo"]) == 2
    assert "--device foo: not a device" in one_line_error(capsys, "train")
    assert main(["info", "--model_size", "debug", "--seq_len", "0"]) == 2
    assert "--seq_len 0" in one_line_error(capsys, "info")


def test_bad_eval_sizes_and_betas_are_one_line(tiny_data, finished_run, tmp_path, capsys):
    for flags, message in ((["--batch_size", "0"], "--batch_size 0 must be >= 1"),
                           (["--eval_batches", "-1"], "--eval_batches -1 must be >= 0 (0: the whole split)"),
                           (["--seq_len", "100000"], "--seq_len 100000 exceeds the model's max_seq_len=")):
        assert main(["eval", "--run", str(finished_run), "--device", "cpu", *flags]) == 2
        assert message in one_line_error(capsys, "eval")
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "run"), *TINY_RUN, "--beta1",
                 "1.5"]) == 2
    assert "beta1=1.5 must lie in [0, 1)" in one_line_error(capsys, "train")
    assert main(["quickstart", "--out", str(tmp_path / "qs"), "--max_new_tokens", "-1"]) == 2
    assert "--max_new_tokens -1 must be >= 0" in one_line_error(capsys, "quickstart")
    assert not (tmp_path / "qs").exists()  # refused before preparing data or training


def test_malformed_run_metadata_is_one_line_for_eval(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    (run / "config.json").write_text("[1, 2]")
    assert main(["eval", "--run", str(run), "--device", "cpu", "--eval_batches", "1"]) == 2
    assert "config.json is corrupt: not a JSON object" in one_line_error(capsys, "eval")
    (run / "config.json").unlink()  # the checkpoints' own configs then stand in
    for ckpt in checkpoints(run):
        rewrite_state(ckpt, lambda state: state.update(curriculum={"mor_ramp": 1.0}))
    assert main(["eval", "--run", str(run), "--device", "cpu", "--eval_batches", "1"]) == 2
    assert "records a malformed curriculum" in one_line_error(capsys, "eval")


def test_generate_on_a_nan_model_is_one_line(finished_run, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    exported = tmp_path / "model.safetensors"
    assert main(["export", "--run", str(finished_run), "--out", str(exported)]) == 0
    with safe_open(str(exported), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(exported), metadata=meta)
    capsys.readouterr()
    assert main(["generate", "--run", str(finished_run), "--checkpoint", str(exported), "--prompt", "the",
                 "--device", "cpu"]) == 2
    assert "holds non-finite weights" in one_line_error(capsys, "generate")


def test_eval_says_when_it_falls_back_to_an_older_checkpoint(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    newest = checkpoints(run)[-1]
    (newest / "model.safetensors").write_bytes(b"garbage")
    assert main(["eval", "--run", str(run), "--eval_batches", "1", "--device", "cpu", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["step"] == 3
    assert f"warning: using the older checkpoint {checkpoints(run)[0]} (step 3): newer ones are unusable" in err
    assert str(newest / "model.safetensors") in err


def test_adaptive_lr_average_follows_a_lasting_new_level():
    from hydra_lm.train import AdaptiveLR

    a = AdaptiveLR(spike=2.0, factor=0.5, cooldown=1)
    for step in range(10):
        assert not a.observe(step, 1.0)
    assert a.observe(10, 3.0)  # a spike...
    spikes = [a.observe(step, 3.0) for step in range(11, 60)]
    assert not any(spikes[-20:])  # ...but a level that lasts becomes the new normal


def test_a_switched_off_optimization_comes_back_after_a_clean_window_and_its_slowdown_switches_nothing_else():
    """A later anomaly restarts the clean window instead of keeping the optimization off for good; and the slower
    path it leaves is a new throughput level, not three drops that would switch the next optimization off."""
    from hydra_lm.train.safe_optimizations import AnomalyMonitor, SafeOptimizations, Switch

    state = {"graphs": True, "compile": True}
    switches = [Switch(name, name, lambda n=name: state.__setitem__(n, False),
                       lambda n=name: state.__setitem__(n, True)) for name in state]
    safe = SafeOptimizations(switches, AnomalyMonitor(window=100, loss_spike=2.0, throughput_drop=0.7),
                             warn=lambda message: None, record=lambda record: None)
    for step in range(0, 200, 10):
        safe.observe(step, 1.0, 1.0, 1000.0)
    for step in (200, 210, 220):  # three loss spikes: the first switch goes off
        safe.observe(step, 5.0, 1.0, 1000.0)
    assert state == {"graphs": False, "compile": True}
    for step in range(230, 400, 10):  # 40% slower without graphs, and one more spike at 240
        safe.observe(step, 5.0 if step == 240 else 1.0, 1.0, 600.0)
    assert state == {"graphs": True, "compile": True}  # back 100 clean steps after the spike at 240
    assert safe.switches[0].on and safe.monitor.last_anomaly == 240


def test_repeated_loss_spikes_switch_the_chunked_loss_off_and_back_on(tiny_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    seen = spike_logged_losses(monkeypatch, {4, 5, 6})
    assert train(tiny_data, run, "--max_steps", "16", "--log_every", "1", "--chunked_ce",
                 "--experimental_safety_window", "6", "--experimental_throughput_drop_threshold", "0.01") == 0
    assert [r["step"] for r in records(run, "anomaly")] == [5, 6, 7]
    switches = [(r["step"], r["action"], r["optimization"]) for r in records(run, "safety")]
    assert switches == [(7, "off", "the fused chunked loss (--chunked_ce)"),
                        (12, "on", "the fused chunked loss (--chunked_ce)")]
    # Steps 1-7 fused; back at the step-6 checkpoint, steps 7-12 on the plain loss; fused again from 13.
    assert seen[:7] == [(s, "auto") for s in range(1, 8)]
    assert seen[7:13] == [(s, "naive") for s in range(7, 13)]
    assert seen[13:] == [(s, "auto") for s in range(13, 17)]


def test_a_switch_goes_back_to_a_checkpoint_from_before_its_anomalies_where_one_is_kept(tiny_data, tmp_path,
                                                                                          monkeypatch):
    run = tmp_path / "run"
    seen = spike_logged_losses(monkeypatch, {4, 5, 6})  # anomalies at 5, 6, 7; checkpoints at 3 and 6
    assert train(tiny_data, run, "--max_steps", "9", "--log_every", "1", "--chunked_ce", "--keep_checkpoints", "3",
                 "--experimental_safety_window", "6", "--experimental_throughput_drop_threshold", "0.01") == 0
    assert seen[7] == (4, "naive")  # from step 3's checkpoint: step 6's was saved inside the burst


def test_a_switch_with_no_checkpoint_to_go_back_to_keeps_the_steps_evaluation_and_save(tiny_data, tmp_path,
                                                                                         monkeypatch):
    run = tmp_path / "run"
    spike_logged_losses(monkeypatch, {4, 5, 6})  # switches the fused loss off at step 7, the run's last
    assert train(tiny_data, run, "--max_steps", "7", "--save_every", "100", "--log_every", "1", "--chunked_ce",
                 "--experimental_safety_window", "6", "--experimental_throughput_drop_threshold", "0.01") == 0
    assert [(r["step"], r["action"]) for r in records(run, "safety")] == [(7, "off")]
    assert [r["step"] for r in records(run, "eval")] == [7]
    assert [p.name for p in checkpoints(run)] == ["hydra_debug_step7"]


def test_repeated_loss_spikes_switch_the_compiled_blocks_off_and_back_on(tiny_data, tmp_path, monkeypatch):
    # One process compiles the blocks in place (no compiled wrapper to drop): the switch must still reach them.
    compile_fn = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn=None, mode=None, options=None, **kw:
                        compile_fn(fn, backend="eager", **kw))  # Dynamo without code generation: fast on CPU
    torch._dynamo.reset()
    run = tmp_path / "run"
    seen = spike_logged_losses(monkeypatch, {4, 5, 6},
                               path=lambda model: "compiled" if model.blocks[1].compiled_block else "eager")
    assert train(tiny_data, run, "--max_steps", "16", "--log_every", "1", "--compile",
                 "--experimental_safety_window", "6", "--experimental_throughput_drop_threshold", "0.01") == 0
    switches = [(r["step"], r["action"], r["optimization"]) for r in records(run, "safety")]
    assert switches == [(7, "off", "torch.compile (--compile)"), (12, "on", "torch.compile (--compile)")]
    assert seen[:7] == [(s, "compiled") for s in range(1, 8)]
    assert seen[7:13] == [(s, "eager") for s in range(7, 13)]
    assert seen[13:] == [(s, "compiled") for s in range(13, 17)]


def test_a_switched_off_optimization_stays_off_across_a_resume_until_it_graduates(tiny_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    seen = spike_logged_losses(monkeypatch, {4, 5, 6})
    flags = ["--max_steps", "16", "--log_every", "1", "--chunked_ce", "--experimental_safety_window", "6",
             "--experimental_throughput_drop_threshold", "0.01"]
    assert train(tiny_data, run, *flags, "--stop_at_step", "9") == 0
    assert verify(checkpoints(run)[-1]).state["safe_optimizations"]["off"] == {"chunked_ce": 6}
    seen.clear()
    assert train(tiny_data, run, *flags) == 0
    # The same decisions as the uninterrupted run above: plain loss up to step 12, fused again from 13.
    assert seen == [(s, "naive") for s in range(10, 13)] + [(s, "auto") for s in range(13, 17)]
    switches = [(r["step"], r["action"]) for r in records(run, "safety")]
    assert switches == [(7, "off"), (12, "on")]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_under_torchrun_rank_0_holds_the_lock_and_a_second_launch_is_refused(tiny_data, tmp_path):
    run = tmp_path / "run"

    def launch(max_steps: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                "hydra_lm", "train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--parallel", "ddp",
                "--max_steps", max_steps, "--save_every", max_steps, "--log_every", "1", "--eval_every", "0",
                "--no-eval_at_start"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A session of its own, so that the launcher is stopped with anything it left in its group.
    first = subprocess.Popen(launch("100000"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                             start_new_session=True)
    try:
        wait_for_training(first, run, 180)
        holder = json.loads((run / ".lock").read_text())["pid"]
        worker_env = open(f"/proc/{holder}/environ", "rb").read().split(b"\0")
        assert b"RANK=0" in worker_env and holder != first.pid  # rank 0's worker, not the launcher
        second = subprocess.run(launch("2"), capture_output=True, text=True, timeout=300, env=env)
        assert second.returncode != 0
        assert f"is in use by another trainer (pid {holder} on host " in second.stderr, second.stderr[-3000:]
        assert first.poll() is None  # the first launch trains on, undisturbed
    finally:
        # The launcher starts its workers in sessions of their own: stop them by pid, or they train on.
        workers = descendants(first.pid)
        os.killpg(first.pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        first.wait()


def wait_for_training(proc: subprocess.Popen, run, seconds: float) -> None:
    """Until the trainer started by ``proc`` has logged a training step (its stderr shown if it died)."""
    deadline = time.monotonic() + seconds
    while not (run / "metrics.jsonl").is_file() or '"kind": "train"' not in (run / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the trainer did not start training"
        time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc: a process's parent is field 4 of its stat line)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def test_decoding_past_the_cache_is_refused_with_what_to_change():
    """Positions past the caches would index out of them (on CUDA, where the decode kernel writes the caches,
    out of bounds): refused before any write."""
    from hydra_lm.model.decode_step import DecodeStep

    model = tiny_model().eval()
    caches = model.init_cache(2, 8)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="positions 6..8 do not fit a cache of 8 positions"):
        model.forward_cached(ids, 6, caches)
    with pytest.raises(ValueError, match="positions 4..8 do not fit"):
        model.forward_cached(ids, torch.tensor([[4], [6]]), caches)
    model.forward_cached(ids, 5, caches)  # 5..7 fit
    step = DecodeStep(model, caches, 2, torch.device("cpu"), graphed=False, compiled=False)
    with pytest.raises(ValueError, match="position 8 is outside the caches' 8 positions"):
        step(ids[:, :1], 8)


def test_loss_spikes_at_every_log_point_can_switch_an_optimization_off_at_production_logging():
    """The monitor sees a loss at log points only: with --log_every 50 a 100-step window held two of them, and three
    anomalies were never reached. The window is widened to hold three."""
    from hydra_lm.train.safe_optimizations import ANOMALIES_TO_SWITCH, AnomalyMonitor, anomaly_window

    assert anomaly_window(100, 10) == 100 and anomaly_window(100, 50) == 101 and anomaly_window(500, 50) == 500
    for log_every in (10, 50, 200):
        monitor = AnomalyMonitor(anomaly_window(100, log_every), loss_spike=2.0, throughput_drop=0.0)
        monitor.observe(0, 1.0, 1.0, 0.0)
        first = next(step for step in range(log_every, 20 * log_every, log_every)
                     if monitor.observe(step, 100.0, 1.0, 0.0) and monitor.too_many())
        assert first == ANOMALIES_TO_SWITCH * log_every


def test_a_second_interrupt_says_the_checkpoints_are_intact_and_how_to_resume(tiny_data, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--stop_at_step", "3") == 0

    def interrupted(self):
        raise KeyboardInterrupt  # what a second Ctrl-C raises, mid-save

    monkeypatch.setattr(Trainer, "_loop", interrupted)
    assert train(tiny_data, run) == 130
    assert f"checkpoint is intact (an unfinished one is cleaned up at the next start): resume with: hydra-lm " \
           f"train --out {run}" in capsys.readouterr().err

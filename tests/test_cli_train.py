"""The command line end to end on a tiny corpus: prepare -> train -> eval -> generate, exact resume,
Ctrl-C, and clear one-line errors for bad input (never losing a checkpoint)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hydra_lm.cli import main
from support import TINY_RUN, prepare, records, rewrite_state, train_losses, write_corpus


def train(data, run, *extra):
    return main(["train", "--data", str(data), "--out", str(run), *TINY_RUN, *extra])


@pytest.mark.slow
def test_prepare_train_eval_generate(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "12", "--log_every", "3", "--eval_every", "6", "--save_every",
                 "4", "--keep_checkpoints", "2", "--lr", "0.01") == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "eval step 12" in out
    train_rs, eval_rs = records(run, "train"), records(run, "eval")
    assert [r["step"] for r in train_rs] == [3, 6, 9, 12]
    for r in train_rs:
        assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "memory_mb", "ce_loss"} <= set(r)
    assert [r["step"] for r in eval_rs] == [0, 6, 12]
    assert all({"val_loss_causal", "val_loss_topk", "val_ppl_causal", "val_ppl_topk"} <= set(r) for r in eval_rs)
    assert eval_rs[-1]["val_loss_causal"] < eval_rs[0]["val_loss_causal"] - 0.5  # it learns
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["hydra_debug_step12", "hydra_debug_step8", "latest"]
    log = (run / "train.log").read_text()
    assert "torch" in log and "git" in log

    assert main(["eval", "--run", str(run), "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 12 and result["val_loss_causal"] > 0 and result["val_loss_topk"] > 0
    assert main(["eval", "--run", str(run), "--checkpoint", str(run / "checkpoints" / "hydra_debug_step8")]) == 0
    assert "step 8" in capsys.readouterr().out

    assert main(["generate", "--run", str(run), "--prompt", "the quick", "--max_new_tokens", "12", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("the quick") and len(text) > len("the quick")
    assert main(["generate", "--run", str(run), "--prompt", "the quick", "--max_new_tokens", "12", "--seed", "3",
                 "--compile_step"]) == 0
    assert capsys.readouterr().out == text  # seeded sampling is reproducible, also with the compiled step
    unfiltered = []
    for top_k in ("0", "100000"):  # 0: no top-k filter, as one wider than the vocabulary
        assert main(["generate", "--run", str(run), "--prompt", "the quick", "--max_new_tokens", "12", "--seed", "3",
                     "--top_k", top_k]) == 0
        unfiltered.append(capsys.readouterr().out)
    assert unfiltered[0] == unfiltered[1]
    # Several prompts sample as one batch; greedy, each gets what it gets alone.
    greedy = ["generate", "--run", str(run), "--max_new_tokens", "12", "--temperature", "0"]
    alone = []
    for prompt in ("the quick", "a"):
        assert main([*greedy, "--prompt", prompt]) == 0
        alone.append(capsys.readouterr().out)
    assert main([*greedy, "--prompt", "the quick", "--prompt", "a"]) == 0
    assert capsys.readouterr().out == f"----- sample 1 of 2 -----\n{alone[0]}----- sample 2 of 2 -----\n{alone[1]}"


@pytest.mark.parametrize("split_at", [5])
@pytest.mark.slow
def test_stop_and_resume_reproduces_the_uninterrupted_run_exactly(tiny_data, tmp_path, split_at):
    common = ["--max_steps", "10", "--log_every", "1", "--eval_every", "4", "--save_every", "3", "--grad_accum", "2",
              "--adaptive_lr", "--mod_enable_pct", "0.3", "--mod_force_enable_pct", "0.6", "--mor_enable_pct", "0.7",
              "--no_short_run_override", "--mod_loss_gate", "5.5", "--experimental_prefetch_threads", "2"]
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    assert train(tiny_data, straight, *common) == 0
    assert train(tiny_data, pieces, *common, "--stop_at_step", str(split_at)) == 0
    assert [s for s, _ in train_losses(pieces)] == list(range(1, split_at + 1))
    assert main(["train", "--out", str(pieces)]) == 0  # everything else comes from the run's config
    assert train_losses(pieces) == train_losses(straight)  # bit-identical per-step losses
    strip = [{k: v for k, v in r.items() if k not in ("eval_s", "train_s")} for r in records(straight, "eval")]
    assert strip == [{k: v for k, v in r.items() if k not in ("eval_s", "train_s")} for r in records(pieces, "eval")]
    a, b = records(straight, "train"), records(pieces, "train")
    assert [(r["mod_active"], r["mor_active"], r["lr"]) for r in a] == [(r["mod_active"], r["mor_active"], r["lr"])
                                                                        for r in b]
    assert any(r["mod_active"] for r in a[split_at:]) and not a[0]["mod_active"]


def test_sigint_saves_a_checkpoint_and_the_run_resumes(tiny_data, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", "import sys; from hydra_lm.cli import main; sys.exit(main())",
           "train", "--data", str(tiny_data), "--out", str(run),
           "--max_steps", "100000", "--log_every", "1", "--no-eval_at_start", "--save_every", "100000", *TINY_RUN]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        metrics = run / "metrics.jsonl"
        while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (0, 130), out
    assert "SIGINT" in out
    ckpts = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("hydra_debug_step")]
    assert len(ckpts) == 1
    step = int(ckpts[0].name.rsplit("step", 1)[1])
    assert step >= 3 and records(run, "train")[-1]["step"] == step
    assert main(["train", "--out", str(run), "--max_steps", str(step + 2), "--log_every", "1"]) == 0
    assert [r["step"] for r in records(run, "train")][-2:] == [step + 1, step + 2]


def test_a_step_that_fails_after_a_stop_signal_stops_the_run_as_interrupted(tiny_data, tmp_path, monkeypatch,
                                                                             capsys):
    """A signal to the whole process group (Ctrl-C, `timeout`, a scheduler) also stops the compiler's
    helper processes, so a compiling step fails: the run says why, keeps its last checkpoint and
    resumes from it."""
    from hydra_lm.train.step import TrainStep

    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "4", "--save_every", "2", "--no-eval_at_start") == 0
    micro, calls = TrainStep.micro, []

    def compile_killed(self, inputs):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
            raise RuntimeError("SubprocPool closed")
        return micro(self, inputs)
    monkeypatch.setattr(TrainStep, "micro", compile_killed)
    assert main(["train", "--out", str(run), "--max_steps", "8"]) == 130
    assert "failed after SIGTERM (RuntimeError: SubprocPool closed" in (run / "train.log").read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if "step" in p.name)[-1].endswith("step4")
    monkeypatch.setattr(TrainStep, "micro", micro)
    assert main(["train", "--out", str(run), "--max_steps", "8"]) == 0
    assert [r["step"] for r in records(run, "train")][-2:] == [4, 8]  # logged every 4 steps


@pytest.mark.parametrize("during", ["last_step", "final_eval"])
def test_a_stop_signal_at_the_end_of_the_run_keeps_its_final_evaluation(tiny_data, tmp_path, monkeypatch, during):
    """The run has nothing left to do but its final checkpoint and evaluation: a first signal must not lose the
    evaluation (a resume would find the run finished and never evaluate it)."""
    from hydra_lm.train import trainer
    from hydra_lm.train.step import TrainStep

    micro, evaluate, calls = TrainStep.micro, trainer.evaluate, []

    def last_step_signalled(self, inputs):
        calls.append(1)
        if len(calls) == 4:
            signal.raise_signal(signal.SIGTERM)
        return micro(self, inputs)

    def eval_signalled(*args):
        signal.raise_signal(signal.SIGTERM)
        return evaluate(*args)
    if during == "last_step":
        monkeypatch.setattr(TrainStep, "micro", last_step_signalled)
    else:
        monkeypatch.setattr(trainer, "evaluate", eval_signalled)
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "4", "--save_every", "2", "--eval_every", "0",
                 "--no-eval_at_start") == 0
    assert [r["step"] for r in records(run, "eval")] == [4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if "step" in p.name)[-1].endswith("step4")


def test_a_step_that_never_finishes_after_a_stop_signal_exits_the_process(monkeypatch):
    from hydra_lm.train import stop_signal

    exits, messages = [], []
    monkeypatch.setattr(stop_signal.os, "_exit", exits.append)
    log = type("Log", (), {"info": messages.append, "warning": messages.append})()
    request = stop_signal.StopRequest(log, grace_s=0.05)
    request._handler(signal.SIGTERM, None)
    time.sleep(0.5)
    assert exits == [130] and "did not finish within" in messages[-1]
    finished = stop_signal.StopRequest(log, grace_s=0.2)
    finished._handler(signal.SIGTERM, None)
    finished.uninstall()  # the step finished and the checkpoint was saved in time
    time.sleep(0.5)
    assert exits == [130]


def test_a_signal_during_a_save_lets_the_save_finish(tiny_data, tmp_path, monkeypatch):
    """A scheduler's SIGTERM that lands while a periodic checkpoint is written does not time the save (the grace
    period, meant for a step that waits on the compiler's killed helpers, exited mid-save and lost the checkpoint,
    blaming "the step in progress"); an error of such a save is its own, not the step's."""
    from hydra_lm.train import stop_signal, trainer
    from hydra_lm.train.checkpoint import CheckpointManager

    exits = []
    monkeypatch.setattr(stop_signal.os, "_exit", exits.append)
    monkeypatch.setattr(trainer, "StopRequest", lambda log: stop_signal.StopRequest(log, grace_s=0.1))
    save = CheckpointManager.save

    def slow_save(self, step, *args, **kwargs):
        if step == 2:
            signal.raise_signal(signal.SIGTERM)
            time.sleep(0.5)  # longer than the grace period
        return save(self, step, *args, **kwargs)
    monkeypatch.setattr(CheckpointManager, "save", slow_save)
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "4", "--save_every", "2", "--no-eval_at_start", "--eval_every", "0",
                 "--log_every", "1") == 130
    assert exits == [] and "did not finish" not in (run / "train.log").read_text()
    assert [p.name for p in (run / "checkpoints").glob("hydra_*")] == ["hydra_debug_step2"]
    assert [r["step"] for r in records(run, "train")] == [1, 2]
    stop = stop_signal.StopRequest(type("Log", (), {"info": print, "warning": print})())
    with pytest.raises(OSError), stop.saving():
        stop._handler(signal.SIGTERM, None)
        raise OSError(28, "No space left on device")
    assert not stop.step_failed(OSError(28, "No space left on device"))


# ---------------------------------------------------------------------- bad input
def err_of(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


def test_missing_and_empty_data_dirs(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r1")]) == 2
    assert "does not exist" in err_of(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["train", "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "r2")]) == 2
    assert "no prepared data" in err_of(capsys)
    assert main(["train", "--out", str(tmp_path / "r3")]) == 2
    assert "no data" in err_of(capsys)


def test_a_resume_steps_with_the_weight_decay_and_betas_it_is_given(tiny_data, tmp_path):
    """The checkpoint's optimizer groups carry the first run's settings; the resumed run's own must win."""
    from hydra_lm.train.checkpoint import verify

    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "4", "--stop_at_step", "2", "--weight_decay", "0.1",
                 "--beta2", "0.95") == 0
    assert train(tiny_data, run, "--max_steps", "4", "--weight_decay", "0.05", "--beta2", "0.99") == 0
    groups = verify(run / "checkpoints" / "hydra_debug_step4").load_trainer()["optimizer"]["param_groups"]
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.05]
    assert {tuple(g["betas"]) for g in groups} == {(0.9, 0.99)}


def test_a_resume_with_a_new_lr_or_length_rederives_what_followed_them_and_keeps_what_the_user_set(tiny_data,
                                                                                                    tmp_path):
    run, kept = tmp_path / "run", tmp_path / "kept"
    assert train(tiny_data, run, "--max_steps", "10", "--stop_at_step", "1", "--lr", "1e-3") == 0
    assert train(tiny_data, run, "--max_steps", "40", "--stop_at_step", "2", "--lr", "5e-5") == 0  # min_lr 1e-4 > lr
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["min_lr"], saved["eval_every"], saved["save_every"]) == (5e-6, 4, 10)
    assert saved["warmup_steps"] == 1  # the schedule's warm-up already ran
    assert train(tiny_data, kept, "--max_steps", "10", "--stop_at_step", "1", "--min_lr", "0", "--eval_every", "3") == 0
    assert train(tiny_data, kept, "--max_steps", "40", "--stop_at_step", "2", "--lr", "5e-4") == 0
    saved = json.loads((kept / "config.json").read_text())["train"]
    assert (saved["min_lr"], saved["eval_every"]) == (0.0, 3)


def test_a_resume_given_dataset_trains_on_it_or_says_why_not(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "4", "--stop_at_step", "2") == 0
    other = prepare(write_corpus(tmp_path / "other_corpus", seed=1), tmp_path / "other", vocab_size=260)
    assert main(["train", "--out", str(run), "--dataset", str(other)]) == 2
    assert "tokenizer mismatch" in err_of(capsys)
    assert main(["train", "--out", str(run), "--dataset", str(tiny_data)]) == 0


def test_the_steps_that_compile_after_a_curriculum_switch_count_as_start_up_not_training(tiny_data, tmp_path,
                                                                                          monkeypatch):
    """A seconds budget counts training time: a compiled run's steps that trace a new routing layout must not eat it
    (dense variants never switch, so it would be charged to routed ones only)."""
    import dataclasses

    from hydra_lm.train.trainer import Trainer

    loop = Trainer._loop

    def as_if_compiled(self):  # the accounting of a compiled run, on eager steps
        self.plan = dataclasses.replace(self.plan, compile="units")
        return loop(self)
    monkeypatch.setattr(Trainer, "_loop", as_if_compiled)
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "8", "--log_every", "1", "--mor_enable_pct", "0.5",
                 "--no-eval_at_start") == 0
    rs = records(run, "train")
    banked = [r["step"] for r, before in zip(rs, [{"startup_s": 0.0}, *rs]) if r["startup_s"] > before["startup_s"]]
    switch = next(r["step"] for r in rs if r["mor_active"])
    assert banked == [1, switch] and switch > 1


def test_a_resumed_windows_start_up_rate_counts_only_the_steps_since_it_reopened(monkeypatch):
    """A window of start-up steps alone is timed from its opening: the steps before the interruption that a resumed
    run's window continues took no part in that time (counted in, they overstated tokens/s tenfold)."""
    import torch

    from hydra_lm.train import log_window

    now = [100.0]
    monkeypatch.setattr(log_window.time, "perf_counter", lambda: now[0])
    window = log_window.LogWindow(torch.device("cpu"), {"sums": [4.0 * 9] * 5 + [9.0], "steps": 9})
    now[0] += 0.5  # the first step after the resume, compiling
    window.add(torch.full((5,), 4.0), torch.tensor(1.0), torch.zeros(0, 3), 1e-3)
    window.restart_timer(now[0])  # the trainer banks that step as start-up
    record, _ = window.record(10, tokens_per_step=1000, run={}, router_names=[], moe_names=[])
    assert record["tokens_per_s"] == pytest.approx(1000 / 0.5)
    for _ in range(2):  # then two training steps in 1 s: the ordinary window's rate
        window.add(torch.full((5,), 4.0), torch.tensor(1.0), torch.zeros(0, 3), 1e-3)
    now[0] += 1.0
    record, _ = window.record(12, tokens_per_step=1000, run={}, router_names=[], moe_names=[])
    assert record["tokens_per_s"] == pytest.approx(2 * 1000 / 1.0)
    assert record["loss"] == pytest.approx(4.0)  # its means still take the steps before the interruption


def test_the_progress_line_shows_a_routed_models_executed_share():
    import torch

    from hydra_lm.train.log_window import LogWindow
    from hydra_lm.train.metrics import progress_line

    window = LogWindow(torch.device("cpu"))
    window.add(torch.full((5,), 4.0), torch.tensor(1.0), torch.tensor([[0.25, 1.0, 0.9], [0.375, 1.0, 0.8]]), 1e-3)
    record, _ = window.record(1, 128, {"memory_mb": 400.0}, ["block1.mod0", "block1.mor1"], [])
    assert progress_line(record, 8).endswith(" | exec 0.31")


def test_eval_json_writes_a_non_finite_number_as_null(monkeypatch, capsys):
    import hydra_lm.infer

    nan = float("nan")
    monkeypatch.setattr(hydra_lm.infer, "eval_run", lambda *args, **kwargs: {
        "step": 8, "val_loss_causal": nan, "val_loss_topk": 4.2, "val_gap": nan,
        "routing": {"block1.mod0": {"agreement": float("inf")}}})
    assert main(["eval", "--run", "unused", "--json"]) == 0
    result = json.loads(capsys.readouterr().out, parse_constant=lambda word: pytest.fail(f"bare {word} in JSON"))
    assert (result["val_loss_causal"], result["val_loss_topk"], result["val_gap"]) == (None, 4.2, None)
    assert result["routing"]["block1.mod0"]["agreement"] is None


@pytest.mark.parametrize("command", ["train", "compare", "bench"])
def test_every_command_runs_with_the_trainers_cuda_allocator_and_a_users_setting_wins(tmp_path, monkeypatch,
                                                                                      command, capsys):
    """`bench` and `compare` time the allocator `train` runs with; PYTORCH_CUDA_ALLOC_CONF set by the user stays."""
    data = ["--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]
    refused = {"train": ["train", *data], "compare": ["compare", "--budget", "tokens=1", *data],
               "bench": ["bench", "--steps", "0"]}[command]  # each refused before any work
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert main(refused) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert main(refused) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_unwritable_run_dir(tiny_data, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert train(tiny_data, blocker / "run", "--max_steps", "1") == 2
    assert "not writable" in err_of(capsys)


def test_out_of_range_token_ids(tiny_data, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_data, bad)
    tokens = np.memmap(bad / "train.bin", dtype=np.uint16, mode="r+")
    tokens[5] = 60000
    tokens.flush()
    del tokens
    assert train(bad, tmp_path / "run", "--max_steps", "1") == 2
    assert "60000" in err_of(capsys)


def test_resume_with_another_tokenizer_is_refused(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "2") == 0
    other = prepare(write_corpus(tmp_path / "c2", seed=1, words=200), tmp_path / "other", vocab_size=300)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert train(other, run, "--max_steps", "4") == 2
    assert "tokenizer mismatch" in err_of(capsys)
    other_vocab = prepare(write_corpus(tmp_path / "c3", seed=2), tmp_path / "other_vocab", vocab_size=320)
    assert train(other_vocab, run, "--max_steps", "4") == 2
    assert "tokenizer mismatch" in err_of(capsys)
    assert train(tiny_data, run, "--max_steps", "4", "--model.dim", "32") == 2
    err = err_of(capsys)  # naming the changed field alone, not every field of the model
    assert "cannot change model when resuming (run has {'dim': 64}, the command line gives {'dim': 32})" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing lost


def test_a_run_saved_before_the_kernel_fields_resumes_and_loads(tiny_data, tmp_path, capsys):
    """Runs recorded before HydraConfig had attention_backend / doc_mask_backend take their defaults (and their
    checkpoints, from before the state's own hash, load without it)."""
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "2", "--save_every", "2") == 0

    def older(model_config):
        assert model_config.pop("attention_backend") == "auto" and model_config.pop("doc_mask_backend") == "auto"
    config = json.loads((run / "config.json").read_text())
    older(config["model"])
    (run / "config.json").write_text(json.dumps(config))
    for ckpt in run.glob("checkpoints/hydra_*"):
        rewrite_state(ckpt, lambda state: older(state["model_config"]), hashed=False)
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert main(["train", "--out", str(run), "--max_steps", "3"]) == 0
    assert "resumed from" in capsys.readouterr().out


@pytest.mark.slow
def test_corrupt_checkpoint_errors_for_eval_and_resume_falls_back(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "4", "--save_every", "2", "--log_every", "1") == 0
    newest = run / "checkpoints" / "hydra_debug_step4" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-50])
    assert main(["eval", "--run", str(run), "--checkpoint", str(newest.parent)]) == 2
    line = err_of(capsys)
    assert line.startswith("hydra-lm eval: error:") and str(newest) in line and "truncated" in line
    assert main(["train", "--out", str(run), "--max_steps", "6", "--log_every", "1"]) == 0
    captured = capsys.readouterr()
    assert "falling back" in captured.err and str(newest) in captured.err
    assert "resumed from" in captured.out and "hydra_debug_step2" in captured.out
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "hydra_debug_step4.corrupt" in names and "hydra_debug_step6" in names
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4, 5, 6]  # redone steps logged once


@pytest.mark.slow
def test_quickstart_runs_end_to_end_on_a_stand_in_corpus(tiny_data, tmp_path, monkeypatch, capsys):
    import hydra_lm.data
    from hydra_lm import quickstart as module

    prepared = []
    monkeypatch.setattr(hydra_lm.data, "prepare_data", lambda inputs, out: prepared.append(inputs) or tiny_data)
    model = {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 128}  # the quickstart's run, shrunk
    monkeypatch.setattr(module, "QUICKSTART", {**module.QUICKSTART, "batch_size": 4, "seq_len": 32,
                                               "eval_batches": 2, "model": model})
    code = module.quickstart(tmp_path / "qs", max_steps=8, prompt="the", max_new_tokens=8, device="cpu")
    out = capsys.readouterr().out
    assert code == 0 and prepared == [None]  # None: the embedded default corpus
    assert "validation loss (causal routing):" in out and "at step 0 ->" in out and "at step 8" in out
    assert "sample (prompt 'the'" in out
    assert (tmp_path / "qs" / "run" / "checkpoints" / "hydra_debug_step8").is_dir()


def test_quickstart_checks_max_steps_before_preparing_the_corpus(tmp_path, monkeypatch):
    import hydra_lm.data
    from hydra_lm import quickstart as module

    def prepare(inputs, out):
        raise AssertionError("the corpus was prepared before --max_steps was checked")

    monkeypatch.setattr(hydra_lm.data, "prepare_data", prepare)
    with pytest.raises(ValueError, match="--max_steps 0 must be >= 1"):
        module.quickstart(tmp_path / "qs", max_steps=0, device="cpu")


@pytest.mark.slow
def test_a_failed_restart_leaves_the_run_as_it_was(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "2") == 0
    saved = (run / "config.json").read_text()
    assert main(["train", "--out", str(run), "--max_steps", "4", "--cuda_graph"]) == 2  # refused on CPU
    assert "--cuda_graph needs a CUDA device" in err_of(capsys)
    assert (run / "config.json").read_text() == saved
    assert main(["train", "--out", str(run), "--max_steps", "4"]) == 0
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == 4


def test_a_stalled_step_leaves_every_threads_stack_in_the_log_and_the_run_goes_on(tiny_data, tmp_path, monkeypatch):
    """--stall_dump_s: a step that makes no progress for that long appends the stacks (naming the function
    it waits in) to train.log; the run then finishes normally, and a healthy run's log holds no dump."""
    from hydra_lm.train.step import TrainStep

    healthy = tmp_path / "healthy"
    assert train(tiny_data, healthy, "--max_steps", "3", "--no-eval_at_start", "--stall_dump_s", "30") == 0
    assert "Stall:" not in (healthy / "train.log").read_text()

    micro, calls = TrainStep.micro, []

    def waits_on_something_that_never_comes(self, inputs):
        calls.append(1)
        if len(calls) == 2:
            time.sleep(1.5)
        return micro(self, inputs)
    monkeypatch.setattr(TrainStep, "micro", waits_on_something_that_never_comes)
    run = tmp_path / "stalled"
    assert train(tiny_data, run, "--max_steps", "3", "--no-eval_at_start", "--stall_dump_s", "0.5") == 0
    log = (run / "train.log").read_text()
    assert "Stall: no training step or evaluation batch finished for" in log and "most recent call last" in log
    assert "waits_on_something_that_never_comes" in log
    assert records(run, "train")[-1]["step"] == 3


def test_a_negative_stall_dump_is_refused(tiny_data, tmp_path, capsys):
    assert train(tiny_data, tmp_path / "run", "--stall_dump_s", "-1") == 2
    assert "stall_dump_s=-1.0 must be >= 0" in capsys.readouterr().err


def test_row_groups_that_do_not_divide_the_batch_are_refused(tiny_data, tmp_path, capsys):
    assert train(tiny_data, tmp_path / "run", "--batch_size", "4", "--model.topk_over", "causal",
                 "--model.topk_groups", "3") == 2
    err = capsys.readouterr().err
    assert "topk_groups=3 pools the batch's rows in equal groups: it must divide batch_size=4" in err


def test_the_grace_period_after_a_signal_bounds_the_step_alone():
    """The first signal's grace period (after which the process exits without a new checkpoint) ends with the step
    in progress: the checkpoint and the final evaluation after it may take longer. Its message is logged then,
    not from the signal handler, where a print can land inside the main thread's; and an error after the step is
    not the interrupted step's."""
    script = textwrap.dedent("""
        import os, signal, time
        from hydra_lm.train.stop_signal import StopRequest

        class Log:
            def info(self, message): print("info:", message, flush=True)
            def warning(self, message): print("warning:", message, flush=True)

        stop = StopRequest(Log(), grace_s=0.5)
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)  # during a step
        time.sleep(0.1)
        print("in the handler's time:", stop.reason, flush=True)
        stop.acknowledge()  # the step ended
        time.sleep(1.0)  # the interrupt checkpoint, longer than the grace period
        print("checkpoint saved", flush=True)
        # an error after the step (a full disk during that save) is its own, not the interrupted step's
        assert not stop.step_failed(OSError(28, "No space left on device"))
        stop.uninstall()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["in the handler's time: SIGTERM",
                     "info: SIGTERM received: the run stops after the step in progress", "checkpoint saved"]


def test_the_same_command_resumes_with_model_overrides_split_over_layers_and_a_presets_other_spelling(tiny_data,
                                                                                                    tmp_path):
    """A run whose model overrides come partly from --config and partly from the command line, and whose preset was
    typed in another case, resumes with the command that started it; a changed override is still refused."""
    config = tmp_path / "run.toml"
    config.write_text('[model]\nn_heads = 2\nn_kv_heads = 1\nmlp_hidden = 128\n')
    run = tmp_path / "run"
    command = ["train", "--data", str(tiny_data), "--out", str(run), "--config", str(config), "--model_size", "Debug",
               "--model.dim", "64", "--batch_size", "4", "--seq_len", "32", "--eval_batches", "1", "--device", "cpu",
               "--log_every", "1", "--no-eval_at_start", "--max_steps", "4"]
    assert main([*command, "--stop_at_step", "2"]) == 0
    assert main(command) == 0
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4]
    assert main([*command[:-1], "6", "--model.dim", "128"]) == 2


def test_a_signal_before_the_first_step_stops_without_a_step(tiny_data, tmp_path, monkeypatch):
    """A signal during the pretest or the first evaluation stops there (exit 130): no first step, which on a GPU is
    a minutes-long compile racing the grace period, and nothing new to save."""
    import hydra_lm.train.trainer as trainer_module

    class SignalDuringPretest:
        def __init__(self, trainer):
            self.trainer = trainer

        def before_training(self):
            self.trainer.stop_request.reason = "SIGTERM"

    monkeypatch.setattr(trainer_module, "PretestHook", SignalDuringPretest)
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "4") == 130
    assert records(run, "train") == [] and not list((run / "checkpoints").glob("*step*"))
    # --out alone would start a new run from the defaults, not this one: the log must not advise it
    log = (run / "train.log").read_text()
    assert "nothing to resume: run the same command again" in log and "resume with" not in log


def test_data_prepared_again_under_a_run_is_warned_about_and_the_resume_says_how_to_go_on(tmp_path, capsys):
    data = prepare(write_corpus(tmp_path / "c1", seed=1), tmp_path / "data", vocab_size=300)
    run = tmp_path / "run"
    assert train(data, run, "--max_steps", "4", "--stop_at_step", "2") == 0
    capsys.readouterr()
    prepare(write_corpus(tmp_path / "c2", seed=2), data, vocab_size=280)  # another corpus into the same directory
    assert "warning: replacing the data prepared in" in capsys.readouterr().err
    assert main(["train", "--out", str(run)]) == 2
    assert "was prepared again since the run started" in err_of(capsys)  # not "resume with" that same directory

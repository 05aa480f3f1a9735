"""--seq_len_schedule: parsing, stage shapes at constant tokens per step, exact resume across a switch."""

import json

import pytest

from hydra_lm.cli import main
from hydra_lm.config import HydraConfig
from hydra_lm.model.accounting import executed_flops_per_token
from hydra_lm.train.seq_len_schedule import SeqLenSchedule, carry_over
from hydra_lm.train.trainer import Trainer
from support import TINY_RUN, train_losses


def test_stages_keep_tokens_per_step_and_switch_at_their_fractions():
    s = SeqLenSchedule.parse("512:0,1024:0.3,2048:0.7")
    assert s.longest == 2048
    assert [s.stage_at(c, 100) for c in (0, 29, 30, 69, 70, 99)] == [0, 0, 1, 1, 2, 2]
    assert [s.shape(i, 8, 2048) for i in range(3)] == [(32, 512), (16, 1024), (8, 2048)]
    state = {"epoch": 1, "position": 96, "seq_len": 512, "batch_size": 32}
    assert carry_over(state, 16, 1024) == {"epoch": 1, "position": 48, "seq_len": 1024, "batch_size": 16}
    for bad in ("512:0.1,1024:0.5", "512:0,1024:0", "512", "512:0,1024:1.0", "1:0,2:0.1,4:0.2,8:0.3,16:0.4",
                "512:0,1024:nan"):
        with pytest.raises(ValueError, match="seq_len_schedule"):
            SeqLenSchedule.parse(bad)
    with pytest.raises(ValueError, match="divide"):
        SeqLenSchedule.parse("48:0,64:0.5").check(batch_size=2, seq_len=64)
    # Row groups of a top-k over the batch split every stage's rows: 4 x 64 tokens are 8 rows of 32, 4 of 64.
    SeqLenSchedule.parse("32:0,64:0.5").check(batch_size=4, seq_len=64, topk_groups=4)
    with pytest.raises(ValueError, match=r"stage 64:0.5 runs micro-batches of 4 rows .* topk_groups=8"):
        SeqLenSchedule.parse("32:0,64:0.5").check(batch_size=4, seq_len=64, topk_groups=8)


def test_resume_across_a_length_switch_is_exact(tiny_data, tmp_path):
    common = ["--data", str(tiny_data), *TINY_RUN, "--log_every", "1", "--no-eval_at_start", "--eval_every", "0",
              "--max_steps", "8", "--save_every", "8", "--seq_len_schedule", "16:0,32:0.5", "--mod_off", "--mor_off"]
    assert main(["train", "--out", str(tmp_path / "straight"), *common]) == 0
    pieces = tmp_path / "pieces"
    assert main(["train", "--out", str(pieces), *common, "--stop_at_step", "3"]) == 0
    assert main(["train", "--out", str(pieces), "--stop_at_step", "6"]) == 0
    assert main(["train", "--out", str(pieces)]) == 0
    assert train_losses(pieces) == train_losses(tmp_path / "straight")
    loaders = {step: json.loads((pieces / "checkpoints" / f"hydra_debug_step{step}" / "state.json").read_text())
               ["loader"] for step in (3, 6)}
    assert (loaders[3]["seq_len"], loaders[3]["batch_size"]) == (16, 8)
    assert (loaders[6]["seq_len"], loaders[6]["batch_size"]) == (32, 4)
    assert "sequence length 16 -> 32, 4 rows" in (tmp_path / "straight" / "train.log").read_text()


def test_a_resume_in_a_later_stage_of_a_length_used_before_stays_in_it(tiny_data, tmp_path):
    """16:0,32:0.3,16:0.6 comes back to rows of 16: a checkpoint from the third stage resumes in the third stage, not
    the first (which took a spurious switch "16 -> 16" at the next step, reset its graphs and booked it as start-up)."""
    common = ["--data", str(tiny_data), *TINY_RUN, "--log_every", "1", "--no-eval_at_start", "--eval_every", "0",
              "--max_steps", "10", "--save_every", "10", "--seq_len_schedule", "16:0,32:0.3,16:0.6", "--mod_off",
              "--mor_off"]
    assert main(["train", "--out", str(tmp_path / "straight"), *common]) == 0
    pieces = tmp_path / "pieces"
    assert main(["train", "--out", str(pieces), *common, "--stop_at_step", "8"]) == 0
    assert main(["train", "--out", str(pieces)]) == 0
    assert train_losses(pieces) == train_losses(tmp_path / "straight")
    assert "16 -> 16" not in (pieces / "train.log").read_text()


def test_mfu_counts_the_stages_own_row_length(tiny_data, tmp_path, monkeypatch):
    """Attention's FLOPs per token grow with the row: the MFU of a step on rows of 16 counts rows of 16, not the
    --seq_len of 32. (A peak rate is set by hand: the trainer measures one on CUDA only.)"""
    init = Trainer.__init__

    def with_peak(self, setup):
        init(self, setup)
        self.peak_flops = 1e12

    monkeypatch.setattr(Trainer, "__init__", with_peak)
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--log_every", "1", "--max_steps",
                 "4", "--no-eval_at_start", "--eval_every", "0", "--seq_len_schedule", "16:0,32:0.5"]) == 0
    model_cfg = HydraConfig.from_saved(json.loads((run / "config.json").read_text())["model"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    for r in train:
        length = 16 if r["step"] <= 2 else 32
        want = executed_flops_per_token(model_cfg, length, training=True) * r["tokens_per_s"] / 1e12
        assert r["mfu"] == pytest.approx(want, rel=1e-9), r["step"]


def test_a_switch_under_compilation_banks_its_own_step_alone_and_a_time_budget_moves_on(tiny_data, tmp_path,
                                                                                       monkeypatch):
    """Compiled runs (CUDA's default; here the plan says so while the step stays eager) bank a switching step as
    start-up. It used to take every step since the last evaluation with it: a seconds budget's position fell back
    before the switch, the stage switched back, and the run never ended."""
    import dataclasses

    run_trainer, train_step, switches = Trainer.run, Trainer._train_step, []

    def compiled(self):
        self.plan = dataclasses.replace(self.plan, compile="units")
        return run_trainer(self)

    def counted(self, window):
        changed = train_step(self, window)
        if changed:
            switches.append(self.loader.seq_len)
            assert len(switches) <= 2, f"the stages switched back and forth: {switches}"
        return changed

    monkeypatch.setattr(Trainer, "run", compiled)
    monkeypatch.setattr(Trainer, "_train_step", counted)
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--log_every", "1", "--max_steps",
                 "1000", "--time_budget_s", "3", "--eval_every", "0", "--no-eval_at_start", "--save_every", "1000",
                 "--seq_len_schedule", "16:0,32:0.25", "--mod_off", "--mor_off"]) == 0
    assert switches == [32]
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert train[-1]["train_s"] >= 3.0 and train[-1]["startup_s"] < 3.0

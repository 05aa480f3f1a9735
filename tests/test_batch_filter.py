"""--batch_filter: outlier losses mask the update on the device, are counted, and resume exactly."""

import math

import pytest
import torch

from hydra_lm.cli import main
from hydra_lm.train.step import TrainStep
from hydra_lm.train.trainer import Trainer
from hydra_lm.train.batch_filter import BatchFilter
from support import TINY_RUN, records, train_losses


def test_outliers_are_masked_and_counted_and_leave_the_statistics_alone():
    f = BatchFilter(k=3.0, device=torch.device("cpu"), warmup=5)
    keeps = [f.keep(torch.tensor(3.0 + 0.1 * math.sin(i))).item() for i in range(8)]
    assert keeps == [1.0] * 8 and f.skipped.item() == 0
    mean, var = f.mean.clone(), f.var.clone()
    assert f.keep(torch.tensor(9.0)).item() == 0.0  # far above mean + 3 std
    assert f.keep(torch.tensor(float("nan"))).item() == 0.0
    assert f.skipped.item() == 2 and torch.equal(f.mean, mean) and torch.equal(f.var, var)
    assert f.keep(torch.tensor(3.05)).item() == 1.0
    early = BatchFilter(k=3.0, device=torch.device("cpu"), warmup=5)
    assert [early.keep(torch.tensor(v)).item() for v in (3.0, 30.0)] == [1.0, 1.0]  # no bar before the warm-up

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([2.0, float("inf"), float("nan")])  # a non-finite batch's gradients
    f.mask([p], torch.tensor(0.0))
    assert torch.equal(p.grad, torch.zeros(3))
    p.grad = torch.full((3,), 2.0)
    f.mask([p], torch.tensor(1.0))
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    restored = BatchFilter(k=3.0, device=torch.device("cpu"))
    restored.load_state_dict(f.state_dict())
    assert restored.state_dict() == f.state_dict()
    older = BatchFilter(k=3.0, device=torch.device("cpu"))
    older.load_state_dict({k: v for k, v in f.state_dict().items() if k != "streak"})  # saved before it existed
    assert older.state_dict() == f.state_dict()


def test_no_warm_up_still_needs_two_losses_and_a_lasting_new_level_is_accepted():
    """Without a variance every loss above the first would be an outlier (none ever accepted); a loss that moves
    for good (a curriculum switch) would be rejected for the rest of the run."""
    level = [3.0 + 0.03 * math.sin(i) for i in range(300)]
    bare = BatchFilter(k=4.0, device=torch.device("cpu"), warmup=0)
    assert sum(bare.keep(torch.tensor(v)).item() for v in level) > 290  # was 0: every loss above the first skipped
    f = BatchFilter(k=4.0, device=torch.device("cpu"), warmup=20)
    assert sum(f.keep(torch.tensor(v)).item() for v in level) == 300
    shifted = [f.keep(torch.tensor(3.4 + 0.03 * math.sin(i))).item() for i in range(200)]
    assert shifted[:10] == [0.0] * 10 and sum(shifted) > 180  # was 0: the run stopped learning


@pytest.mark.slow
def test_filtered_run_logs_skips_and_resumes_exactly(tiny_data, tmp_path, monkeypatch):
    # The loss the filter sees at 0-based step 3 is x10, at step 6 NaN: one outlier before the step-5 checkpoint,
    # one after it, so the resumed run must carry the filter's statistics and count over. The skipped NaN batch
    # changed nothing, so it is no divergence either.
    step_of, micro = [0], TrainStep.micro_step
    train_step = Trainer._train_step
    monkeypatch.setattr(Trainer, "_train_step", lambda self, window: step_of.__setitem__(0, self.step) or
                        train_step(self, window))

    def outlier_micro_step(self, *args, **kwargs):
        parts, stats = micro(self, *args, **kwargs)
        return {3: parts * 10, 6: parts * float("nan")}.get(step_of[0], parts), stats

    monkeypatch.setattr(TrainStep, "micro_step", outlier_micro_step)
    common = ["--data", str(tiny_data), *TINY_RUN, "--log_every", "1", "--no-eval_at_start", "--eval_every", "0",
              "--max_steps", "8", "--save_every", "5", "--batch_filter", "--batch_filter_k", "3",
              "--batch_filter_warmup", "2", "--mod_off", "--mor_off"]
    assert main(["train", "--out", str(tmp_path / "straight"), *common]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces"), *common, "--stop_at_step", "5"]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces")]) == 0
    assert records(tmp_path / "straight", "divergence") == []
    straight = train_losses(tmp_path / "straight")
    assert straight[6][1] is None  # a window of the skipped NaN step alone: no loss, logged as null
    assert train_losses(tmp_path / "pieces") == straight
    skipped = [r["skipped_batches"] for r in records(tmp_path / "straight", "train")]
    assert skipped == [0, 0, 0, 1, 1, 1, 2, 2]  # a running count: the two outliers alone
    assert skipped == [r["skipped_batches"] for r in records(tmp_path / "pieces", "train")]


def _inject_outliers(monkeypatch, outliers: dict) -> None:
    """Scale the loss the filter sees at the given 0-based steps (by x10 or NaN)."""
    step_of, micro, train_step = [0], TrainStep.micro_step, Trainer._train_step
    monkeypatch.setattr(Trainer, "_train_step", lambda self, window: step_of.__setitem__(0, self.step) or
                        train_step(self, window))

    def outlier_micro_step(self, *args, **kwargs):
        parts, stats = micro(self, *args, **kwargs)
        return parts * outliers.get(step_of[0], 1.0), stats

    monkeypatch.setattr(TrainStep, "micro_step", outlier_micro_step)


def test_a_skipped_batch_feeds_neither_the_logged_loss_nor_the_adaptive_lr_nor_the_anomaly_monitor(
        tiny_data, tmp_path, monkeypatch):
    # Step 3's loss is x10, step 6's NaN: both skipped. Logged every step (no adaptive LR) the run gives each kept
    # step's loss; logged every 5 steps with the adaptive LR, each window must log the mean of its kept steps and
    # the LR must stay the schedule's (a skipped batch once made the window NaN or x3, which halved the LR and
    # recorded an anomaly, and so also changed the training after it).
    _inject_outliers(monkeypatch, {3: 10.0, 6: float("nan")})
    common = ["--data", str(tiny_data), *TINY_RUN, "--no-eval_at_start", "--eval_every", "0", "--max_steps", "15",
              "--save_every", "100", "--batch_filter", "--batch_filter_k", "3", "--batch_filter_warmup", "2",
              "--mod_off", "--mor_off"]
    assert main(["train", "--out", str(tmp_path / "each"), *common, "--log_every", "1"]) == 0
    assert main(["train", "--out", str(tmp_path / "windows"), *common, "--log_every", "5", "--adaptive_lr",
                 "--adaptive_lr_cooldown", "10"]) == 0
    each = {r["step"]: r for r in records(tmp_path / "each", "train")}
    assert each[4]["loss"] is None and each[7]["loss"] is None  # a window of a skipped step alone has no loss
    windows = records(tmp_path / "windows", "train")
    assert [r["step"] for r in windows] == [5, 10, 15]
    for r in windows:
        kept = [each[s]["loss"] for s in range(r["step"] - 4, r["step"] + 1) if s not in (4, 7)]
        assert r["loss"] == pytest.approx(sum(kept) / len(kept), rel=1e-4)
        assert r["lr"] == pytest.approx(each[r["step"]]["lr"])  # no adaptive-LR cut
    assert [r["skipped_batches"] for r in windows] == [1, 2, 2]
    assert records(tmp_path / "windows", "anomaly") == []

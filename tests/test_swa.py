"""--swa: the running average (weights and router thresholds), its checkpoint file, exact resume, final eval."""

import json

import torch
from safetensors.torch import load_file

from support import tiny_model
from hydra_lm.cli import main
from hydra_lm.train.swa import SWA_FILE, WeightAverage
from support import TINY_RUN, records, train_losses


def test_average_covers_weights_and_router_thresholds_from_the_start_step_on():
    model = tiny_model()
    avg = WeightAverage(model, start_step=1)
    snapshots = []
    for step in (1, 2, 3):
        with torch.no_grad():
            for t in [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith("threshold_sum"))]:
                t.add_(torch.randn_like(t))
        avg.update(model, step)
        if step > 1:
            snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
    assert avg.steps_averaged == 2
    averaged = avg.module.state_dict()
    thresholds = [k for k in averaged if k.endswith("threshold_sum")]
    assert thresholds
    for key in [*thresholds, "embed.weight"]:
        torch.testing.assert_close(averaged[key], (snapshots[0][key] + snapshots[1][key]) / 2)


def test_a_checkpoint_records_the_averages_count_and_one_that_also_holds_the_start_step_loads(tmp_path):
    """The start step comes from the run's config: a checkpoint records the count alone (older ones also hold
    ``start_step``, which loading ignores)."""
    model = tiny_model()
    avg = WeightAverage(model, start_step=0)
    avg.update(model, 1)
    assert avg.state_dict() == {"steps_averaged": 1}
    avg.save(tmp_path)
    restored = WeightAverage(tiny_model(seed=1), start_step=0)
    restored.load(tmp_path, {"start_step": 0, "steps_averaged": 1})
    assert restored.steps_averaged == 1
    assert all(torch.equal(a, b) for a, b in zip(restored.module.state_dict().values(),
                                                 avg.module.state_dict().values()))


def test_swa_run_saves_the_average_resumes_exactly_and_evaluates_it(tiny_data, tmp_path):
    common = ["--data", str(tiny_data), *TINY_RUN, "--log_every", "1", "--no-eval_at_start", "--eval_every", "0",
              "--max_steps", "8", "--save_every", "4", "--swa", "--swa_start_pct", "0.5", "--mod_enable_pct", "0",
              "--mod_force_enable_pct", "0", "--mor_enable_pct", "0"]
    assert main(["train", "--out", str(tmp_path / "straight"), *common]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces"), *common, "--stop_at_step", "6"]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces")]) == 0
    assert train_losses(tmp_path / "pieces") == train_losses(tmp_path / "straight")
    finals = [records(tmp_path / run, "eval")[-1] for run in ("straight", "pieces")]
    assert finals[0]["swa_val_loss_causal"] == finals[1]["swa_val_loss_causal"]
    assert finals[0]["swa_val_loss_topk"] == finals[1]["swa_val_loss_topk"]
    assert finals[0]["swa_val_loss_causal"] != finals[0]["val_loss_causal"]
    ckpts = {run: tmp_path / run / "checkpoints" / "hydra_debug_step8" for run in ("straight", "pieces")}
    state = json.loads((ckpts["straight"] / "state.json").read_text())
    assert SWA_FILE in state["files"] and state["swa"] == {"steps_averaged": 4}  # the start: the run's config
    a, b = (load_file(str(p / SWA_FILE)) for p in ckpts.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    raw = load_file(str(ckpts["straight"] / "model.safetensors"))
    assert any(not torch.equal(a[k], raw[k]) for k in raw)

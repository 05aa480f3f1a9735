"""Which settings a run is started, resumed, exported and evaluated with: a resume refuses only a changed model,
a checkpoint is described by the settings it records, and a warm-up longer than a new run is said."""

import json

from hydra_lm.cli import main
from support import TINY_RUN, records


def train(data, run, *extra):
    return main(["train", "--data", str(data), "--out", str(run), *TINY_RUN, *extra])


def test_a_checkpoint_is_described_by_the_settings_it_was_trained_with_not_a_later_resumes(tiny_data, tmp_path):
    """config.json holds the latest start's settings: an export or evaluation of a checkpoint saved before a resume
    that changed the learning rate and document masking must see the checkpoint's own."""
    from safetensors import safe_open

    from hydra_lm.infer.runs import export_model, load_run

    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "2", "--save_every", "2", "--lr", "0.002") == 0
    assert train(tiny_data, run, "--max_steps", "3", "--save_every", "3", "--lr", "0.001",
                 "--no-document_masking") == 0
    first = run / "checkpoints" / "hydra_debug_step2"
    assert load_run(run, first, "cpu").config["train"]["document_masking"] is True
    assert load_run(run, None, "cpu").config["train"]["document_masking"] is False
    out = export_model(run, tmp_path / "step2.safetensors", first)
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["train_config"])["lr"] == 0.002


def test_a_resume_takes_unchanged_model_settings_and_another_attention_kernel(tiny_data, tmp_path, capsys):
    """What a resume refuses is a changed model: a model field given at its value (the run's own config file fed
    back to it) is no change, and the kernel choices (how attention is computed, not what) may change, as eval and
    generate already let them."""
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "2", "--save_every", "2") == 0
    built = json.loads((run / "config.json").read_text())["model"]
    assert train(tiny_data, run, "--max_steps", "3", "--save_every", "3", "--model.dim", str(built["dim"]),
                 "--model.n_blocks", str(built["n_blocks"]), "--model.doc_mask_backend", "sdpa") == 0
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in records(run, "train") if r["step"] == 3]


def test_a_warm_up_longer_than_a_new_run_is_warned_about(tiny_data, tmp_path, capsys):
    """The learning rate would never reach --lr. Allowed (a resume that shortens a run keeps its warm-up), but said."""
    assert train(tiny_data, tmp_path / "run", "--max_steps", "2", "--warmup_steps", "5") == 0
    assert "--warmup_steps 5 is longer than the run (--max_steps 2)" in capsys.readouterr().err
    assert train(tiny_data, tmp_path / "ok", "--max_steps", "2", "--warmup_steps", "2") == 0
    assert "longer than the run" not in capsys.readouterr().err

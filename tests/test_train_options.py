"""Train settings: per-size defaults, config files, CLI precedence, model overrides, unknown keys."""

import json

import pytest
import torch

from hydra_lm.cli import main
from hydra_lm.train.flags import load_config_file, parse_value, split_model_overrides, to_toml
from hydra_lm.train.compile_policy import SpeedPlan, apply_speed_plan, resolve_speed_options
from hydra_lm.train.options import TrainConfig, normalize, resolve
from hydra_lm.train.run import merge_layers
from support import TINY_RUN, records


def test_per_size_defaults_follow_the_seed_tables():
    big = resolve(TrainConfig(), "1B", on_cuda=True)
    assert (big.batch_size, big.grad_accum, big.seq_len, big.grad_clip) == (2, 30, 1024, 1.0)
    eight = resolve(TrainConfig(optimizer="adam8bit"), "500M", on_cuda=True)
    assert (eight.batch_size, eight.grad_accum) == (4, 15)
    cpu = resolve(TrainConfig(), "debug", on_cuda=False)
    assert (cpu.batch_size, cpu.grad_accum, cpu.seq_len, cpu.lr) == (16, 1, 128, 2e-3)
    assert cpu.min_lr == pytest.approx(2e-4) and cpu.warmup_steps == 100 and cpu.eval_every == 100
    prod = resolve(TrainConfig(mode="production"), "100M", on_cuda=True)
    assert prod.max_steps == 20000 and prod.log_every == 50
    explicit = resolve(TrainConfig(batch_size=3, lr=1e-4), "1B", on_cuda=True)
    assert (explicit.batch_size, explicit.lr) == (3, 1e-4)
    assert resolve(TrainConfig(checkpoint_every=2), "debug", False).gradient_checkpointing


def test_a_cuda_run_on_the_table_gets_the_largest_micro_batch_that_fits_the_gpu(monkeypatch):
    from types import SimpleNamespace

    from hydra_lm.config import preset_config
    from hydra_lm.train.memory_estimate import measure_training_memory
    from hydra_lm.train import fit_batch, run
    from hydra_lm.train.metrics import RunLog

    cfg = resolve(TrainConfig(model_size="1B"), "1B", on_cuda=True)  # the table: 2 x 30 sequences
    model_cfg = preset_config("debug", vocab_size=512)
    gib = 2 ** 30
    # The memory model of the run's config at its sequence length and optimizer. The debug preset at 256
    # tokens: about 368 MB at 15 sequences, 451 MB at 20; 0.7 of 600 MB is 420.
    short = cfg.replace(seq_len=256)
    batch, accum, peak = fit_batch.fit_micro_batch(short, model_cfg, 600 * 2 ** 20)
    assert (batch, accum) == (15, 4)
    assert peak == pytest.approx(measure_training_memory(model_cfg, 15, 256, device="cuda")["peak_mb"], rel=1e-3)
    assert measure_training_memory(model_cfg, 20, 256, device="cuda")["peak_mb"] > 420 >= peak
    # A synthetic peak of 1 GiB per sequence: 0.7 of 32 GiB holds 22 sequences, so 20 (a divisor of 60);
    # none fits in half a GiB.
    monkeypatch.setattr(fit_batch, "measure_training_memory", lambda cfg, batch, *a, **k: {"peak_mb": 1024.0 * batch})
    assert fit_batch.fit_micro_batch(cfg, model_cfg, 32 * gib) == (20, 3, 20 * 1024.0)
    assert fit_batch.fit_micro_batch(cfg, model_cfg, 200 * gib)[:2] == (60, 1)
    assert fit_batch.fit_micro_batch(cfg, model_cfg, gib // 2)[:2] == (1, 60)
    # Row groups of a top-k over the batch: micro-batches they split evenly (15, not 20; 3 when none fits).
    grouped = model_cfg.replace(topk_over="causal", topk_groups=3)
    assert fit_batch.fit_micro_batch(cfg, grouped, 32 * gib) == (15, 4, 15 * 1024.0)
    assert fit_batch.fit_micro_batch(cfg, grouped, gib // 2)[:2] == (3, 20)
    # What the trainer's setup does with it on a GPU, and says.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=32 * gib))
    lines = []
    log = RunLog(None, echo=False)
    monkeypatch.setattr(log, "info", lines.append)
    fitted = run._fit_batch_to_gpu(cfg, model_cfg, torch.device("cuda"), log, eval_from_table=True)
    assert (fitted.batch_size, fitted.grad_accum) == (20, 3)
    assert fitted.eval_batches == 2  # the mode's 20 evaluation batches of 2 sequences: 40 sequences
    assert run._fit_batch_to_gpu(cfg, model_cfg, torch.device("cuda"), log, eval_from_table=False).eval_batches == 20
    assert "micro-batch fitted to the GPU: 20 x 1024 x accumulation 3 (the 1B table's 2 x 30" in lines[0]


@pytest.mark.parametrize("flags, routing", [
    (dict(mod_off=True, mor_off=True), (False, False, 1.0)),
    (dict(mod_enable_pct=0.1, mod_force_enable_pct=0.2), (False, True, 1.0)),  # dense until the loss gate opens
    (dict(mor_ramp=True), (True, True, 0.25)),  # the ramp's first level, near full depth
], ids=["routing_off", "mod_later", "mor_ramp"])
def test_the_fitted_micro_batch_fits_the_routing_of_the_runs_first_step(flags, routing):
    """A curriculum that starts dense or deep holds more activations than the routed model: the fit budgets for
    the run's first step (routers only switch on later, and the ramp moves away from full depth)."""
    from hydra_lm.config import preset_config
    from hydra_lm.train.fit_batch import FIT_SHARE, fit_micro_batch
    from hydra_lm.train.memory_estimate import measure_training_memory

    cfg = resolve(TrainConfig(model_size="1B", max_steps=1000, **flags), "1B", on_cuda=True).replace(seq_len=256)
    model_cfg = preset_config("debug", vocab_size=512)
    gpu = 600 * 2 ** 20  # the routed model fits 15 of the 60 sequences (the test above)
    batch, accum, peak = fit_micro_batch(cfg, model_cfg, gpu)

    def estimate(b, state):
        return measure_training_memory(model_cfg, b, 256, device="cuda", curriculum=state)["peak_mb"]

    assert batch * accum == 60 and batch < 15
    assert peak == pytest.approx(estimate(batch, routing), rel=1e-3) and peak <= FIT_SHARE * 600
    larger = min(d for d in (10, 12, 15, 20, 30, 60) if d > batch)
    assert estimate(larger, routing) > FIT_SHARE * 600 >= estimate(larger, (True, True, 1.0))


def test_the_trainer_fits_the_micro_batch_only_where_the_user_left_it_to_the_table(tiny_data, tmp_path, monkeypatch):
    """setup_run on a (pretended) 80 GB GPU: the 100M table's 32 x 4 sequences become one micro-batch of
    128 (and the mode's 20 evaluation batches of 32 sequences 5 of 128); an explicit --batch_size or
    --grad_accum keeps the table's other half."""
    from types import SimpleNamespace

    from hydra_lm.train import fit_batch, run

    monkeypatch.setattr(run, "pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2 ** 30))
    monkeypatch.setattr(fit_batch, "measure_training_memory", lambda cfg, batch, *a, **k: {"peak_mb": 300.0 * batch})

    def setup(name, **extra):
        s = run.setup_run({"data": str(tiny_data), "out": str(tmp_path / name), "model_size": "100M", **extra},
                          echo=False)
        s.close()
        return s.cfg

    fitted = setup("fitted")
    assert (fitted.batch_size, fitted.grad_accum, fitted.eval_batches) == (128, 1, 5)
    log = (tmp_path / "fitted" / "train.log").read_text()
    assert "micro-batch fitted to the GPU: 128 x 1024 x accumulation 1" in log
    explicit, accum = setup("explicit", batch_size=16), setup("accum", grad_accum=2)
    assert (explicit.batch_size, explicit.grad_accum, accum.batch_size, accum.grad_accum) == (16, 4, 32, 2)


def test_validation_errors_are_clear():
    with pytest.raises(ValueError, match="mod_force_enable_pct"):
        resolve(TrainConfig(mod_enable_pct=0.5, mod_force_enable_pct=0.2), "debug", False)
    with pytest.raises(ValueError, match="min_lr"):
        resolve(TrainConfig(lr=1e-3, min_lr=1e-2), "debug", False)
    with pytest.raises(ValueError, match="stop_at_step"):
        resolve(TrainConfig(max_steps=10, stop_at_step=11), "debug", False)
    with pytest.raises(ValueError, match="time_budget_s=inf must be a finite number"):
        resolve(TrainConfig(time_budget_s=float("inf")), "debug", False)
    for cooldown in (0, -3):
        with pytest.raises(ValueError, match=f"adaptive_lr_cooldown={cooldown} must be >= 1"):
            resolve(TrainConfig(adaptive_lr=True, adaptive_lr_cooldown=cooldown), "debug", False)
    # A warm-up as long as the run stays allowed: a resume that shortens a run keeps its first start's warm-up.
    assert resolve(TrainConfig(max_steps=10, warmup_steps=11), "debug", False).warmup_steps == 11


def test_checkpoint_every_implies_checkpointing_unless_it_is_turned_off_explicitly():
    on = resolve(TrainConfig(checkpoint_every=2), "debug", False)
    assert (on.gradient_checkpointing, on.checkpoint_every) == (True, 2)
    assert resolve(TrainConfig(), "debug", False).gradient_checkpointing is False
    off = resolve(TrainConfig(checkpoint_every=2, gradient_checkpointing=False), "debug", False)
    assert (off.gradient_checkpointing, off.checkpoint_every) == (False, None)  # was forced on
    # A resumed run keeps its saved checkpoint_every, and --no-gradient_checkpointing turns it off all the same.
    saved = on.to_dict()
    resumed = resolve(merge_layers({}, {"gradient_checkpointing": False}, saved), "debug", False)
    assert (resumed.gradient_checkpointing, resumed.checkpoint_every) == (False, None)
    kept = resolve(merge_layers({}, {}, saved), "debug", False)
    assert (kept.gradient_checkpointing, kept.checkpoint_every) == (True, 2)


CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("device, distributed, expected", [
    (CUDA, False, SpeedPlan("units", True, "chunked", 4096, update_graphed=True,  # the fast path
                            parallel_compile=True)),
    (CUDA, True, SpeedPlan("model", False, "auto", 4096)),  # torchrun: whole model, no graphs
    (CPU, False, SpeedPlan(None, False, "naive", 4096)),  # the CPU stays eager
], ids=["cuda", "torchrun", "cpu"])
def test_speed_defaults_follow_the_device_and_process_count(device, distributed, expected):
    assert resolve_speed_options(TrainConfig(), device, distributed) == expected


@pytest.mark.parametrize("settings, expected", [
    (dict(compile=False, cuda_graph=False, chunked_ce=False), SpeedPlan(None, False, "naive", 4096)),
    # not capturable: forward + backward graphed, the update eager
    (dict(optimizer="lion"), SpeedPlan("units", True, "chunked", 4096, parallel_compile=True)),
    # Muon's step (train/muon.py) is captured like fused AdamW's
    (dict(optimizer="muon"), SpeedPlan("units", True, "chunked", 4096, update_graphed=True,
                                       parallel_compile=True)),
    (dict(gradient_checkpointing=True, chunked_ce_size=512),
     SpeedPlan("units", False, "auto", 512, parallel_compile=True)),
    # Sophia-G's Hessian estimate is an ordinary backward: compiled and graphed like Lion
    (dict(optimizer="sophia"), SpeedPlan("units", True, "chunked", 4096, parallel_compile=True)),
    # the block layouts compiled one after the other in the step
    (dict(parallel_compile=False), SpeedPlan("units", True, "chunked", 4096, update_graphed=True)),
])
def test_speed_opt_outs_and_automatic_fallbacks_on_cuda(settings, expected):
    assert resolve_speed_options(TrainConfig(**settings), CUDA, False) == expected


def test_the_parallel_compile_is_automatic_on_cuda_only():
    # on a CPU of few cores the helpers compete with the step's own compile for the cores
    assert resolve_speed_options(TrainConfig(compile=True), CPU, False).parallel_compile is False
    assert resolve_speed_options(TrainConfig(compile=True, parallel_compile=True), CPU, False).parallel_compile


@pytest.mark.parametrize("settings, device, distributed, message", [
    (dict(cuda_graph=True, gradient_checkpointing=True), CUDA, False, "drop one of them"),
    (dict(cuda_graph=True), CPU, False, "needs a CUDA device"),
    (dict(parallel_compile=True), CPU, False, "add --compile"),  # the CPU runs eagerly by default
    (dict(parallel_compile=True), CUDA, True, "drop it under torchrun"),
    (dict(parallel_compile=True, compile=False), CUDA, True, "drop it under torchrun"),
    (dict(cuda_graph=True), CUDA, True, "one process only"),
    (dict(ce_impl="chunked"), CPU, False, "add --chunked_ce"),
    (dict(chunked_ce=True, ce_impl="liger", cuda_graph=True), CUDA, False, "cannot capture Liger"),
    (dict(chunked_ce=True, ce_impl="liger"), CPU, False, "liger"),
])
def test_speed_combinations_that_cannot_work_are_refused(settings, device, distributed, message):
    with pytest.raises(ValueError, match=message):
        resolve_speed_options(TrainConfig(**settings), device, distributed)


def test_the_speed_plan_is_applied_to_the_model():
    from support import tiny_model

    model = tiny_model()
    units = SpeedPlan("units", False, "chunked", 64)
    assert apply_speed_plan(model, model, units) is model  # compiled in place, the step calls the model
    assert all(b.compiled_unit is not None for b in model.blocks)
    assert (model.ce_impl, model.ce_chunk_size) == ("chunked", 64)
    whole = tiny_model()
    compiled = apply_speed_plan(whole, whole, SpeedPlan("model", False, "naive", 4096))
    assert compiled is not whole and compiled._orig_mod is whole  # torchrun's plan: a compiled wrapper
    assert all(b.compiled_unit is None for b in whole.blocks)
    eager = tiny_model()
    assert apply_speed_plan(eager, eager, SpeedPlan(None, False, "naive", 4096)) is eager
    assert all(b.compiled_unit is None for b in eager.blocks)


def test_old_runs_saved_with_compile_units_still_load():
    assert normalize({"compile_units": True, "lr": 1e-3}, "config.json") == {"compile": True, "lr": 1e-3}
    assert normalize({"compile_units": False}, "config.json") == {}


def test_removed_options_say_what_replaced_them(capsys):
    for command in ("train", "bench"):
        for flag in ("--compile_regions", "--compile_mode"):
            with pytest.raises(SystemExit):
                main([command, flag, "default"])
            assert f"{flag} was removed" in capsys.readouterr().err
    for key in ("compile_regions", "compile_mode"):
        with pytest.raises(ValueError, match=f"--{key} was removed"):
            normalize({key: "default"}, "config file c.toml")
    # a run saved with them resumes on the default path (merge_layers keeps only today's fields)
    saved = {**TrainConfig().to_dict(), "compile_regions": True, "compile_mode": "max-autotune-no-cudagraphs"}
    assert merge_layers({}, {}, saved) == merge_layers({}, {}, TrainConfig().to_dict())


def test_a_new_mode_on_resume_brings_its_own_length_logging_and_evaluation_size():
    """A run saved resolved in testing mode, resumed with --mode production: the settings it had from the old mode
    (and those derived from its length) take the new mode's, what was given explicitly stays."""
    saved = resolve(TrainConfig(mode="testing", eval_batches=7), "debug", False).to_dict()
    resumed = resolve(merge_layers({}, {"mode": "production"}, saved), "debug", False)
    fresh = resolve(TrainConfig(mode="production"), "debug", False)
    for key in ("max_steps", "log_every", "eval_every", "save_every", "min_lr"):
        assert getattr(resumed, key) == getattr(fresh, key), key
    assert resumed.eval_batches == 7 and resumed.warmup_steps == saved["warmup_steps"]  # given; already run
    kept = resolve(merge_layers({}, {}, saved), "debug", False)
    assert (kept.max_steps, kept.log_every) == (saved["max_steps"], saved["log_every"])


def test_model_overrides_parse_from_argv():
    rest, overrides = split_model_overrides(["train", "--model.dim", "64", "--model.mod_capacity=0.5",
                                             "--model.moe", "true", "--lr", "1"])
    assert rest == ["train", "--lr", "1"]
    assert overrides == {"dim": 64, "mod_capacity": 0.5, "moe": True}
    assert parse_value("null") is None and parse_value("hydra") == "hydra" and parse_value("[1, 2]") == [1, 2]
    assert split_model_overrides(["--model.rope_theta", "-1"])[1] == {"rope_theta": -1}
    for argv in (["--model.mod_capacity", "--max_steps", "3"], ["--model.mod_capacity"]):  # the value left out
        with pytest.raises(ValueError, match="--model.mod_capacity needs a value"):
            split_model_overrides(argv)


def test_config_file_toml_yaml_and_aliases(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 0.001\n8bit_adam = true\nschedule = "cosine"\n[model]\ndim = 64\n')
    assert load_config_file(toml) == {"lr": 0.001, "optimizer": "adam8bit", "schedule": "cosine",
                                      "model": {"dim": 64}}
    yaml = tmp_path / "c.yaml"
    yaml.write_text("lr: 0.002\nmodel:\n  mod_capacity: 0.5\n")
    assert load_config_file(yaml) == {"lr": 0.002, "model": {"mod_capacity": 0.5}}
    bad = tmp_path / "bad.toml"
    bad.write_text("lrr = 1\n")
    with pytest.raises(ValueError, match="unknown training key 'lrr'.*did you mean lr"):
        load_config_file(bad)
    wrong_type = tmp_path / "t.toml"
    wrong_type.write_text('max_steps = "ten"\n')
    with pytest.raises(ValueError, match="max_steps"):
        load_config_file(wrong_type)
    broken = tmp_path / "broken.toml"
    broken.write_text("lr = = 1\n")
    with pytest.raises(ValueError, match="cannot be parsed"):
        load_config_file(broken)


def test_toml_copy_round_trips(tmp_path):
    values = {**TrainConfig(max_steps=5, data="d").to_dict(), "model": {"dim": 64, "head_dim": None}}
    path = tmp_path / "round.toml"
    path.write_text(to_toml(values))
    loaded = load_config_file(path)
    assert loaded["max_steps"] == 5 and loaded["data"] == "d" and loaded["model"] == {"dim": 64}


def test_cli_overrides_config_file_and_resolved_config_is_written(tiny_data, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("lr = 0.001\nbatch_size = 2\nwarmup_steps = 1\nschedule = 'cosine'\n"
                   "[model]\nmod_capacity = 0.5\nmlp_hidden = 96\n")
    run = tmp_path / "run"
    args = ["train", "--config", str(cfg), "--data", str(tiny_data), "--out", str(run), "--max_steps", "2",
            "--lr", "0.005", *TINY_RUN, "--model.mlp_hidden", "128"]
    args[args.index("--batch_size") + 1] = "3"
    assert main(args) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["lr"] == 0.005  # CLI beats the file
    assert saved["train"]["batch_size"] == 3
    assert saved["train"]["warmup_steps"] == 1 and saved["train"]["schedule"] == "cosine"  # from the file
    assert saved["model"]["mod_capacity"] == 0.5 and saved["model"]["mlp_hidden"] == 128 and saved["model"]["dim"] == 64
    assert saved["model"]["vocab_size"] == 300  # from the data's tokenizer
    assert "git" in saved and saved["versions"]["torch"]
    assert (run / "config.toml").is_file() and (run / "train.log").read_text().count("hydra-lm") >= 1
    # The resolved config.toml, given back as --config, builds the same run again (HYDRA and dense alike).
    for arch, first in (("hydra", run), ("dense", tmp_path / "dense"), ("dataset", tmp_path / "dataset")):
        if arch != "hydra":  # dense; and a run given --dataset, which resolves into --data
            source = ["--dataset" if arch == "dataset" else "--data", str(tiny_data)]
            assert main(["train", *source, "--out", str(first), "--max_steps", "2", *TINY_RUN,
                         *(["--arch", "dense"] if arch == "dense" else [])]) == 0
        again = tmp_path / f"again_{arch}"
        assert main(["train", "--config", str(first / "config.toml"), "--out", str(again)]) == 0
        rebuilt = json.loads((again / "config.json").read_text())
        assert rebuilt["model"] == json.loads((first / "config.json").read_text())["model"], arch
    # Its resolved sizes under another preset's name would mislabel the model: refused.
    assert main(["train", "--config", str(run / "config.toml"), "--out", str(tmp_path / "renamed"),
                 "--model_size", "50M"]) == 2


@pytest.mark.parametrize("extra, message", [
    (["--model.bogus", "1"], "unknown HydraConfig key 'bogus'"),
    (["--model.mod_capacity", "1.5"], "mod_capacity"),
    (["--8bit_adam"], "--8bit_adam"),
    (["--8bit_adam", "--adafactor"], "--adafactor contradicts --8bit_adam"),  # the flags as typed
    (["--optimizer", "lion", "--adafactor"], "--adafactor contradicts --optimizer lion"),
    (["--no-cuda_graph", "--experimental_cuda_graphs"], "--experimental_cuda_graphs contradicts --no-cuda_graph"),
    (["--chunked_ce_size", "0"], "chunked_ce_size=0 must be >= 1"),
    (["--chunked_ce", "--ce_impl", "liger"], "impl 'liger'"),  # CPU (and no liger-kernel here): refused up front
    (["--cuda_graph"], "--cuda_graph needs a CUDA device"),
    # 4 x 48 tokens: 6 rows at the second stage, which 4 row groups do not split (it crashed when the stage began)
    (["--seq_len", "48", "--seq_len_schedule", "48:0,32:0.5", "--model.topk_over", "batch", "--model.topk_groups", "4"],
     "seq_len_schedule stage 32:0.5 runs micro-batches of 6 rows (batch_size x seq_len / 32), which model "
     "topk_groups=4 does not split"),
])
def test_bad_settings_fail_with_one_line(tiny_data, tmp_path, capsys, extra, message):
    code = main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "run"), "--max_steps", "2", *TINY_RUN,
                 *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.startswith("hydra-lm train: error:")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_resume_with_another_optimizer_is_refused_and_the_run_still_resumes(tiny_data, tmp_path, capsys):
    """The checkpoint holds the run's optimizer's state, which another optimizer cannot load (it crashed inside the
    first step, after config.json had taken the new optimizer, so that every later resume crashed too)."""
    run = tmp_path / "run"
    common = [*TINY_RUN, "--max_steps", "4", "--log_every", "1", "--no-eval_at_start", "--eval_every", "0"]
    assert main(["train", "--data", str(tiny_data), "--out", str(run), *common, "--stop_at_step", "2"]) == 0
    config = (run / "config.json").read_text()
    for flags in (["--optimizer", "muon"], ["--adafactor"]):
        assert main(["train", "--out", str(run), *flags]) == 2
        assert "cannot change optimizer when resuming (run has 'adamw', the command line gives" in \
            capsys.readouterr().err
    assert (run / "config.json").read_text() == config
    assert main(["train", "--out", str(run), "--optimizer", "adamw"]) == 0  # the run's own: nothing changes
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4]


def test_unknown_key_in_config_file_via_cli(tiny_data, tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("warmup = 3\n")
    assert main(["train", "--config", str(cfg), "--data", str(tiny_data), "--out", str(tmp_path / "r")]) == 2
    assert "unknown training key 'warmup'" in capsys.readouterr().err


def test_model_overrides_only_for_train(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--run", "x", "--model.dim", "64"])
    assert "--model.*" in capsys.readouterr().err


def test_no_resume_refuses_a_run_directory_with_checkpoints(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    common = [*TINY_RUN, "--max_steps", "3", "--log_every", "1", "--no-eval_at_start", "--eval_every", "0"]
    assert main(["train", "--data", str(tiny_data), "--out", str(run), *common, "--no-resume",
                 "--stop_at_step", "1"]) == 0  # no checkpoint yet: a new run
    assert main(["train", "--out", str(run), "--no-resume"]) == 2  # it resumed silently
    assert f"--no-resume: {run} has checkpoints" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3]


def test_an_attention_kernel_that_document_masks_bypass_is_said_to_be_bypassed():
    """--model.attention_backend flash (or xformers, or --experimental_fa3) serves attention without document masks
    only: a run that masks documents (the default) must hear that its choice takes no effect, and how to make it."""
    import hydra_lm
    from hydra_lm.train.model_features import apply_model_features

    model = hydra_lm.create_model("debug", dim=64, attention_backend="flash")
    notes = apply_model_features(model, TrainConfig(), torch.device("cpu"))
    assert len(notes) == 1 and "add --no-document_masking for flash to take effect" in notes[0]
    assert apply_model_features(model, TrainConfig(document_masking=False), torch.device("cpu")) == []
    fa3 = apply_model_features(hydra_lm.create_model("debug", dim=64), TrainConfig(experimental_fa3=True),
                               torch.device("cpu"))
    assert len(fa3) == 1 and ("not used" in fa3[0] or "not among them" in fa3[0])  # no FA3 here: nothing to bypass
    assert "--no-document_masking" not in fa3[0]
    import hydra_lm.train.model_features as features
    with pytest.MonkeyPatch.context() as patch:  # where FA3 is SDPA's flash kernel, the masks bypass it
        patch.setattr(features, "enable_fa3", lambda device: ("--experimental_fa3: FA3 on", True))
        fa3 = apply_model_features(hydra_lm.create_model("debug", dim=64), TrainConfig(experimental_fa3=True),
                                   torch.device("cpu"))
    assert fa3[0].endswith("add --no-document_masking for FA3 to take effect")


def test_model_arch_contradicting_arch_is_refused():
    """--arch dense --model.arch hydra trained HYDRA while the saved train config said dense, and a resume checked
    --arch against the wrong one."""
    from types import SimpleNamespace

    from hydra_lm.train.run import build_model_config

    data = SimpleNamespace(vocab_size=256, path="d")
    with pytest.raises(ValueError, match="--model.arch hydra contradicts --arch dense: give --arch alone"):
        build_model_config(TrainConfig(arch="dense", model={"arch": "hydra"}), data)
    same = resolve(TrainConfig(arch="dense", model={"arch": "dense"}), "debug", on_cuda=False)
    assert build_model_config(same, data).arch == "dense"
    # Fields the architecture ignores: the run would train what it trains without them (compare refuses them too).
    for arch, model, message in (("dense", {"recursions": 4}, "--model.recursions does nothing for --arch dense"),
                                 ("hydra", {"n_layers": 12}, "n_layers is the dense baseline's depth")):
        with pytest.raises(ValueError, match=message):
            build_model_config(resolve(TrainConfig(arch=arch, model=model), "debug", on_cuda=False), data)


def test_a_gpu_index_the_machine_does_not_have_is_refused_with_how_many_it_has(monkeypatch):
    from hydra_lm.train.run import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine shows 2 GPU\(s\), numbered from 0"):
        pick_device("cuda:2")


def test_a_config_files_aliases_are_booleans_and_agree_with_the_fields_they_set_in_any_order():
    """The CLI refuses an alias that contradicts its field; a config file must too, whichever key comes first, and a
    string "false" is not true."""
    with pytest.raises(ValueError, match=r"f.toml: adafactor='false' must be true or false"):
        normalize({"adafactor": "false"}, "f.toml")
    for values in ({"optimizer": "lion", "adafactor": True}, {"adafactor": True, "optimizer": "lion"}):
        with pytest.raises(ValueError, match=r"adafactor contradicts optimizer='lion': keep one"):
            normalize(values, "f.toml")
    with pytest.raises(ValueError, match="8bit_adam contradicts adafactor"):
        normalize({"adafactor": True, "8bit_adam": True}, "f.toml")
    with pytest.raises(ValueError, match="experimental_cuda_graphs contradicts cuda_graph=False"):
        normalize({"experimental_cuda_graphs": True, "cuda_graph": False}, "f.toml")
    assert normalize({"adafactor": True, "optimizer": "adafactor"}, "f.toml")["optimizer"] == "adafactor"
    assert "optimizer" not in normalize({"adafactor": False}, "f.toml")


def test_the_python_setup_types_and_checks_its_settings_like_the_command_line(tmp_path):
    """setup_run (the Python API's entry) took a dict as given: "1e-3" failed deep inside, moe=True was unknown."""
    from hydra_lm.train.run import setup_run

    with pytest.raises(ValueError, match="setup_run's settings: max_steps=5.5 must be of type int"):
        setup_run({"out": str(tmp_path / "r"), "max_steps": 5.5})
    assert not (tmp_path / "r").exists()  # refused before anything was made


def test_moe_on_a_gpu_whose_grouped_gemm_syncs_trains_without_cuda_graphs(monkeypatch):
    """torch's grouped GEMM runs without a host sync on compute capability 9.x and 10.x only; elsewhere (an A100, an
    RTX card) a captured MoE step would fail: graphs are left off, and asking for them is refused, naming why."""
    from hydra_lm.model import moe

    for capability, syncs in (((8, 0), True), ((9, 0), False), ((10, 0), False), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert moe.grouped_mm_syncs(CUDA) is syncs
        assert resolve_speed_options(TrainConfig(), CUDA, False, moe=True).cuda_graph is not syncs
        assert resolve_speed_options(TrainConfig(), CUDA, False, moe=False).cuda_graph
    with pytest.raises(ValueError, match=r"--cuda_graph with MoE .* capability 9.x and 10.x only \(this one is 12.0\)"):
        resolve_speed_options(TrainConfig(cuda_graph=True), CUDA, False, moe=True)
    assert moe.grouped_mm_syncs(CPU)

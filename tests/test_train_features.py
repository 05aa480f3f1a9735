"""Optional trainer features run (or refuse clearly): optimizers, checkpointing, dense arch, --dataset,
optional loggers, a data directory without a validation split."""

import contextlib
import importlib.util
import io
import json
import multiprocessing
import shutil
import sys

import pytest
import torch

from hydra_lm.cli import main
from hydra_lm.data import prepare_data
from hydra_lm.train import optim
from hydra_lm.train.data_io import dataset_dir, open_data
from hydra_lm.train.options import TrainConfig
from support import TINY_RUN, count_calls, prepare, records, write_corpus


def train(data, run, *extra):
    return main(["train", "--data", str(data), "--out", str(run), "--max_steps", "3", "--log_every", "1",
                 "--no-eval_at_start", *TINY_RUN, *extra])


@pytest.mark.parametrize("extra", [["--adafactor"], ["--gradient_checkpointing"], ["--checkpoint_every", "2"],
                                   ["--arch", "dense"], ["--schedule", "cosine", "--grad_clip", "0"]],
                         ids=["adafactor", "grad_ckpt", "ckpt_every_2", "dense", "cosine_noclip"])
def test_feature_runs_and_is_recorded(tiny_data, tmp_path, extra):
    assert train(tiny_data, tmp_path / "run", *extra) == 0
    losses = [r["loss"] for r in records(tmp_path / "run", "train")]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    expected = {"--adafactor": ("train", "optimizer", "adafactor"),
                "--gradient_checkpointing": ("train", "gradient_checkpointing", True),
                "--checkpoint_every": ("train", "checkpoint_every", 2), "--arch": ("model", "arch", "dense"),
                "--schedule": ("train", "schedule", "cosine")}[extra[0]]
    assert saved[expected[0]][expected[1]] == expected[2]
    if "--grad_clip" in extra:
        assert saved["train"]["grad_clip"] == 0


def test_gradient_checkpointing_and_chunked_ce_do_not_change_the_numbers(tiny_data, tmp_path, monkeypatch):
    import hydra_lm.model.hydra as hydra_module

    calls = {"checkpoint": 0, "fused loss": 0}  # that each run used what it asked for (the numbers cannot show it)
    count_calls(monkeypatch, hydra_module, "checkpoint", calls, "checkpoint")
    count_calls(monkeypatch, hydra_module, "linear_cross_entropy", calls, "fused loss")
    evals = ["--eval_every", "3", "--eval_batches", "2"]  # causal evaluation reads the calibrated thresholds
    assert train(tiny_data, tmp_path / "a", *evals) == 0
    assert calls == {"checkpoint": 0, "fused loss": 0}
    assert train(tiny_data, tmp_path / "b", "--gradient_checkpointing", *evals) == 0
    assert calls["checkpoint"] > 0 and calls["fused loss"] == 0
    assert train(tiny_data, tmp_path / "c", "--chunked_ce", "--chunked_ce_size", "100", *evals) == 0
    assert calls["fused loss"] > 0
    a = [r["loss"] for r in records(tmp_path / "a", "train")]
    a_eval = [(r["val_loss_causal"], r["val_loss_topk"]) for r in records(tmp_path / "a", "eval")]
    assert len(a_eval) == 1
    for other in ("b", "c"):
        assert a == pytest.approx([r["loss"] for r in records(tmp_path / other, "train")], rel=1e-5)
        other_eval = [(r["val_loss_causal"], r["val_loss_topk"]) for r in records(tmp_path / other, "eval")]
        assert other_eval[0] == pytest.approx(a_eval[0], rel=1e-5)


@pytest.mark.slow
def test_compiled_training_gives_the_eager_numbers(tiny_data, tmp_path, monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")  # the trainer's graph, without inductor's C++ build on CPU
    compile_fn = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, options=None, **kw:
                        compile_fn(model, backend=counter, **kw))
    torch._dynamo.reset()
    phase = ["--mor_enable_pct", "1"]  # MoR at full depth during these 3 steps (the graph counts below)
    assert train(tiny_data, tmp_path / "eager", *phase) == 0
    assert train(tiny_data, tmp_path / "compiled", "--compile", *phase) == 0  # the CPU's default is eager
    eager = [r["loss"] for r in records(tmp_path / "eager", "train")]
    assert eager == pytest.approx([r["loss"] for r in records(tmp_path / "compiled", "train")], rel=1e-5)
    # training: one graph per block layout (MoD-routed at depth 0 or not); evaluation: one unit graph
    # without gradients for every unit, whose top-k rows and causal masked entries both pass a mask
    layered = [g for g in counter.graphs if any("layers" in str(n.target) for n in g.graph.nodes)]
    masked = [g for g in layered if any(n.name == "l_valid_" for n in g.graph.nodes)]
    assert len(layered) == 3 and len(masked) == 1, [g.graph for g in counter.graphs]
    assert "routed units" in (tmp_path / "compiled" / "train.log").read_text()


@pytest.mark.slow
def test_document_masking_can_be_switched_off(tmp_path):
    short_docs = prepare(write_corpus(tmp_path / "corpus", n_docs=80, words=6), tmp_path / "data")
    assert train(short_docs, tmp_path / "a") == 0
    assert train(short_docs, tmp_path / "b", "--no-document_masking") == 0
    masked = [r["loss"] for r in records(tmp_path / "a", "train")]
    plain = [r["loss"] for r in records(tmp_path / "b", "train")]
    assert masked[0] != pytest.approx(plain[0], rel=1e-6)  # rows hold several documents: masking matters
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["train"]["document_masking"] is False


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, keep = optim.param_groups(model, 0.1)
    assert [p.dim() for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in keep["params"]) and keep["weight_decay"] == 0.0
    opt = optim.build_optimizer(model, TrainConfig(lr=1e-3), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW)


def test_dataset_flag_takes_a_prepared_directory(tiny_data, tmp_path):
    assert main(["train", "--dataset", str(tiny_data), "--out", str(tmp_path / "run"), "--max_steps", "1",
                 *TINY_RUN]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["path"] == str(tiny_data)


def test_dataset_specs_named_alike_get_directories_of_their_own(tmp_path, monkeypatch):
    """`--dataset corpus` in two projects names two corpora: each gets its own cache directory (they shared one,
    each start preparing over the other's data), and a corpus named by another path finds its own."""
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    dirs = []
    for project in ("a", "b"):
        write_corpus(tmp_path / project / "corpus", n_docs=8, seed=len(dirs))
        monkeypatch.chdir(tmp_path / project)
        dirs.append(dataset_dir("corpus"))
    assert dirs[0] != dirs[1] and all(d.name.startswith("corpus-") for d in dirs)
    assert dataset_dir(str(tmp_path / "a" / "corpus")) == dirs[0]


def _prepare_as_a_rank(spec: str, start, logs) -> None:
    start.wait()
    with contextlib.redirect_stdout(io.StringIO()) as log:
        dataset_dir(spec)
    logs.put(log.getvalue())


def test_ranks_given_one_dataset_prepare_it_once(tmp_path, monkeypatch):
    """Every torchrun rank runs `--dataset` before the process group forms: one prepares, the others wait for it
    (all of them prepared into one directory at once, replacing each other's files)."""
    corpus = write_corpus(tmp_path / "corpus", n_docs=200)
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    context = multiprocessing.get_context("spawn")
    start, logs = context.Barrier(2), context.Queue()
    ranks = [context.Process(target=_prepare_as_a_rank, args=(str(corpus), start, logs)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    outputs = [logs.get(timeout=300) for _ in ranks]
    for rank in ranks:
        rank.join(60)
    assert [rank.exitcode for rank in ranks] == [0, 0]
    assert sorted("] preparing " in out for out in outputs) == [False, True]


def test_a_damaged_tokenizer_is_an_error_not_a_missing_one(tiny_data, tmp_path):
    """Only data prepared without a tokenizer has none; a damaged tokenizer.json turned the run's tokenizer check
    off."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    text = (data / "tokenizer.json").read_text()
    (data / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="tokenizer recorded for data directory .* cannot be loaded.*prepare the data"):
        open_data(data)
    torch.save(torch.arange(3, 300).view(3, -1), tmp_path / "shard.pt")
    shards = prepare_data([str(tmp_path / "shard.pt")], tmp_path / "shards", val_fraction=0.0, progress=False)
    assert open_data(shards).tokenizer_fingerprint is None


@pytest.mark.parametrize("flag, package", [("--tensorboard", "tensorboard"), ("--wandb", "wandb")])
def test_optional_loggers_need_their_package(tiny_data, tmp_path, capsys, flag, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    assert train(tiny_data, tmp_path / "run", flag) == 2
    assert f"{flag} needs the {package} package" in capsys.readouterr().err


def test_a_refused_logger_flag_leaves_the_saved_config_and_a_plain_resume_works(tiny_data, tmp_path, monkeypatch,
                                                                                capsys):
    # Once saved into config.json before the check, the flag made every plain resume fail the same way.
    run = tmp_path / "run"
    assert train(tiny_data, run, "--stop_at_step", "1") == 0
    saved = (run / "config.json").read_text()
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import fails
        assert main(["train", "--out", str(run), "--tensorboard"]) == 2
    assert "--tensorboard needs the tensorboard package" in capsys.readouterr().err
    assert (run / "config.json").read_text() == saved
    assert main(["train", "--out", str(run)]) == 0
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3]


def test_data_without_validation_split_trains_and_warns(tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["prepare", "--inputs", str(write_corpus(tmp_path / "c", n_docs=10)), "--out", str(data),
                 "--vocab_size", "300", "--val_fraction", "0", "--no_progress"]) == 0
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--max_steps", "2",
                 *TINY_RUN]) == 0
    assert "no validation split" in capsys.readouterr().err
    assert records(tmp_path / "run", "eval") == []


def test_a_cpu_runs_optimizer_state_resumes_into_a_fused_adamw():
    """A checkpoint of a CPU run (AdamW unfused) resumed where AdamW is fused (CUDA; torch's CPU fused kernel stands
    in): the groups stay fused, as the step's clipping inside the update expects, and step with the loaded state."""
    model = torch.nn.Linear(4, 2)
    cpu_run = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    cpu_run.step()
    saved = optim.portable_optimizer_state(cpu_run.state_dict())
    fused = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    optim.load_keeping_lr(fused, lambda: fused.load_state_dict(saved), torch.device("cpu"))
    assert fused.param_groups[0]["fused"] and not fused.param_groups[0]["foreach"]
    fused.grad_scale = torch.tensor(1.0)  # what clipping inside the fused update sets (step.py)
    fused.step()
    assert all(st["step"].item() == 2 for st in fused.state.values())


def test_graph_capturable_optimizer_keeps_checkpoints_portable():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    optim.make_capturable(opt, torch.device("cpu"))
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and all(g["lr"] is lr and g["capturable"] for g in opt.param_groups)
    optim.set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.25  # refilled in place, where a graph reads it
    saved = optim.portable_optimizer_state(opt.state_dict())
    assert saved["param_groups"][0]["lr"] == 0.25 and saved["param_groups"][0]["capturable"] is False
    assert opt.param_groups[0]["capturable"] and opt.param_groups[0]["lr"] is lr  # the live optimizer is unchanged
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(saved)
    fresh.step()  # a plain (non-capturable) run steps with the loaded state
    assert fresh.param_groups[0]["lr"] == 0.25
    # A rollback reloads the portable state into the live, captured optimizer: the graphs read the same LR
    # tensor afterwards, the groups stay capturable and the step counters stay device tensors.
    optim.load_keeping_lr(opt, lambda: opt.load_state_dict(saved), torch.device("cpu"))
    group = opt.param_groups[0]
    assert group["lr"] is lr and group["capturable"] and group["lr_ratio"] == 1.0
    assert all(st["step"].dtype == torch.float32 for st in opt.state.values())


def test_metrics_lines_are_strict_json_with_nested_non_finite_values(tmp_path):
    """A NaN inside a nested record (a router's share, an expert's load) is written as null, like a top-level one:
    strict readers (jq, JSON.parse) reject NaN."""
    from hydra_lm.train.metrics import MetricsWriter, RunLog

    writer = MetricsWriter(tmp_path, RunLog(None, echo=False))
    writer.write({"kind": "train", "step": 1, "loss": float("nan"), "routing": {"block1.mod0": float("inf")},
                  "moe_expert_load": {"after_block0": [0.5, float("nan")]}})
    writer.close()
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    record = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))
    assert record["loss"] is None and record["routing"]["block1.mod0"] is None
    assert record["moe_expert_load"]["after_block0"] == [0.5, None]


def test_a_resume_keeps_the_rollback_its_checkpoint_was_written_after(tmp_path):
    """Diverged at step 80, rolled back to 50, saved at 60 at the lowered learning rate, stopped, resumed from 60:
    the steps after 60 are redone (their records dropped), but the rollback stays, or a compare of the run would
    rank its halved learning rate as the rate it was given. A rollback to the resumed step itself was not written
    into that checkpoint: it goes with the steps after it."""
    from hydra_lm.train.metrics import MetricsWriter, RunLog

    records = [{"kind": "train", "step": 50}, {"kind": "eval", "step": 50}, {"kind": "train", "step": 60},
               {"kind": "divergence", "step": 80, "action": "rollback", "to_step": 50},
               {"kind": "train", "step": 60}, {"kind": "train", "step": 70},
               {"kind": "divergence", "step": 90, "action": "rollback", "to_step": 60}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    MetricsWriter(tmp_path, RunLog(None, echo=False), resume_step=60).close()
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == records[:5]


def test_a_resume_on_a_host_without_the_saved_logger_says_how_to_go_on(tiny_data, tmp_path, monkeypatch, capsys):
    import hydra_lm.train.metrics as metrics
    import hydra_lm.train.run as run_module

    run = tmp_path / "run"
    with monkeypatch.context() as patch:  # a host with tensorboard (a stub writer)
        patch.setattr(run_module, "check_logger_packages", lambda tensorboard, wandb: None)
        patch.setattr(metrics, "check_logger_packages", lambda tensorboard, wandb: None)
        patch.setattr(metrics, "open_tensorboard", lambda directory, purge_step: type(
            "W", (), {"add_scalar": lambda *a: None, "close": lambda self: None})())
        assert train(tiny_data, run, "--stop_at_step", "1", "--tensorboard") == 0
    capsys.readouterr()
    with monkeypatch.context() as patch:  # another without it
        patch.setitem(sys.modules, "torch.utils.tensorboard", None)
        assert main(["train", "--out", str(run)]) == 2
        assert "the run's saved config has it: pass --no-tensorboard to resume without it" in capsys.readouterr().err
        assert main(["train", "--out", str(run), "--no-tensorboard"]) == 0


def test_tensorboard_hides_the_steps_a_resume_or_a_rollback_redoes_and_files_events_under_their_kind(tmp_path,
                                                                                                       monkeypatch):
    import hydra_lm.train.metrics as metrics

    opened, scalars = [], []

    class Writer:  # what SummaryWriter is given (tensorboard is not installed here)
        def __init__(self, directory, purge_step):
            opened.append(purge_step)

        def add_scalar(self, tag, value, step):
            scalars.append((tag, step))

        def close(self):
            pass

    monkeypatch.setattr(metrics, "open_tensorboard", Writer)
    monkeypatch.setattr(metrics, "check_logger_packages", lambda tensorboard, wandb: None)
    log = metrics.RunLog(None, echo=False)
    metrics.MetricsWriter(tmp_path, log, tensorboard=True).close()  # a fresh start: every earlier event hidden
    writer = metrics.MetricsWriter(tmp_path, log, tensorboard=True, resume_step=60)
    writer.write({"kind": "divergence", "step": 80, "loss": 9.5})
    writer.rewind(50)
    writer.write({"kind": "train", "step": 51, "loss": 3.0})
    writer.close()
    assert opened == [0, 61, 51]
    assert scalars == [("divergence/loss", 80), ("loss", 51)]  # an event's loss is no point of the training curve


def test_a_resumed_run_logs_to_its_own_wandb_run(tmp_path, monkeypatch):
    """--wandb: a resume continues the W&B run its start made (the id kept in the run directory); a fresh start in
    the same directory makes a new one. (A stand-in module records what wandb.init was given.)"""
    import sys
    import types

    from hydra_lm.train.metrics import MetricsWriter, RunLog

    ids = []
    run = types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kw: ids.append(kw["id"]) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for resume_step in (-1, 5, -1):
        MetricsWriter(tmp_path, RunLog(None, echo=False), wandb=True, resume_step=resume_step).close()
    assert ids[0] == ids[1] != ids[2]

"""Multi-process training on CPU (gloo, 2 processes under torchrun), FSDP2 and DDP.

Equivalence: 2 ranks x accumulation k see the rows that 1 process x accumulation 2k sees, so the
per-step losses agree to float rounding. Resume: exact on the same world size; on another world
size model and optimizer are restored (and here, with the same global batch, the losses continue
to agree). Gradient checkpointing is on in the multi-process runs, so it is covered too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from hydra_lm.cli import main
from hydra_lm.train import setup_run
from hydra_lm.train.checkpoint import verify
from hydra_lm.train.trainer import Trainer
from support import TINY_RUN, train_losses

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

# MoD switches on at step 2 and MoR at step 3, so routers start without optimizer state mid-run.
COMMON = [*TINY_RUN, "--max_steps", "6", "--log_every", "1", "--save_every", "3", "--eval_every", "3",
          "--mod_enable_pct", "0.3", "--mod_force_enable_pct", "0.3", "--mor_enable_pct", "0.5",
          "--no_short_run_override"]
TOL = 1e-5


def torchrun(data, run, *extra, nproc: int = 2, check: bool = True, script=None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """``hydra-lm train`` on ``nproc`` ranks (or ``script``, a file that runs the CLI, with the same arguments)."""
    entry = ["-m", "hydra_lm"] if script is None else [str(script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           *entry, "train", "--data", str(data), "--out", str(run), *COMMON, "--gradient_checkpointing", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def single(data, run, *extra) -> None:
    assert main(["train", "--data", str(data), "--out", str(run), *COMMON, *extra]) == 0


def assert_close(a, b, tol=TOL):
    assert [s for s, _ in a] == [s for s, _ in b]
    worst = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    assert worst <= tol, f"per-step losses differ by {worst:.2e}: {a} vs {b}"


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """Per-step losses of one process with accumulation 2k: what 2 processes with k must reproduce."""
    cache = {}

    def losses(accum: int):
        if accum not in cache:
            run = tmp_path_factory.mktemp("single") / "run"
            single(tiny_data, run, "--grad_accum", str(accum))
            cache[accum] = train_losses(run)
        return cache[accum]

    return losses


@pytest.mark.parametrize("parallel,accum,save", [("fsdp", 2, "--async_checkpoint"),
                                                 ("ddp", 1, "--no-async_checkpoint")])
@pytest.mark.slow
def test_two_ranks_match_one_rank_and_resume(tiny_data, tmp_path, reference, parallel, accum, save):
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    k = str(accum)
    out = torchrun(tiny_data, straight, "--parallel", parallel, "--grad_accum", k).stdout
    assert f"{parallel.upper()} on 2 processes" in out
    assert_close(train_losses(straight), reference(2 * accum))
    ckpt = verify(straight / "checkpoints" / "hydra_debug_step6")
    assert ckpt.layout == "dcp" and ckpt.world_size == 2 and "loader_ranks" not in ckpt.state
    assert {"rank0.pt", "rank1.pt", "dcp/.metadata"} <= set(ckpt.state["files"])

    # Same world size: stop at step 3, resume, and every step after is bit-identical.
    torchrun(tiny_data, pieces, "--parallel", parallel, "--grad_accum", k, "--stop_at_step", "3", save)
    assert [s for s, _ in train_losses(pieces)] == [1, 2, 3]
    torchrun(tiny_data, pieces, "--parallel", parallel, "--grad_accum", k, save)
    assert train_losses(pieces) == train_losses(straight)

    # Another world size: the 2-rank checkpoint of step 3 resumed by one process (accumulation 2k).
    one = tmp_path / "one"
    shutil.copytree(pieces, one)
    shutil.rmtree(one / "checkpoints" / "hydra_debug_step6")
    (one / "checkpoints" / "latest").write_text("hydra_debug_step3\n")
    single(tiny_data, one, "--grad_accum", str(2 * accum))
    assert_close(train_losses(one), train_losses(straight))


@pytest.mark.slow
def test_asynchronous_saves_do_not_cross_the_ranks_agreement_collectives(tiny_data, tmp_path):
    """DCP's background thread ran its collectives on the group the main thread agrees on (stop signals, barriers):
    with a save at step 3 and no logging or evaluation between the steps the run hung after that save. Its own
    group keeps the two apart: the run ends, with both checkpoints committed."""
    run = tmp_path / "run"
    torchrun(tiny_data, run, "--parallel", "ddp", "--async_checkpoint", "--log_every", "3", "--eval_every", "0",
             "--no-eval_at_start", timeout=240)
    assert [s for s, _ in train_losses(run)] == [3, 6]
    for step in (3, 6):
        assert verify(run / "checkpoints" / f"hydra_debug_step{step}").layout == "dcp"


# Each rank's own expert load (the last micro-batch's) and what its log window adds up, one JSON line a step.
LOAD_RECORDER = """
import json, os, sys

from hydra_lm.cli import main
from hydra_lm.train.log_window import LogWindow
from hydra_lm.train.step import TrainStep


def dump(kind, load):
    with open(os.path.join(os.environ["LOAD_DIR"], f"{kind}{os.environ['RANK']}.jsonl"), "a") as f:
        f.write(json.dumps(load.tolist()) + "\\n")


micro_step, add_moe_load = TrainStep.micro_step, LogWindow.add_moe_load
TrainStep.micro_step = lambda self, *a, **k: (micro_step(self, *a, **k), dump("local", self.moe_load))[0]
LogWindow.add_moe_load = lambda self, load: (dump("logged", load), add_moe_load(self, load))[1]
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_every_rank_logs_the_expert_load_averaged_over_ranks(tiny_data, tmp_path, monkeypatch):
    """Like the losses and routing statistics, the MoE expert load each rank's log window sums is the mean of the
    ranks' own, so every rank logs (and warns about starving experts) on the same numbers."""
    script = tmp_path / "record_loads.py"
    script.write_text(LOAD_RECORDER)
    monkeypatch.setenv("LOAD_DIR", str(tmp_path))
    torchrun(tiny_data, tmp_path / "run", "--grad_accum", "1", "--max_steps", "3", "--eval_every", "0",
             "--no-eval_at_start", "--moe", "--moe_num_experts", "4", "--moe_num_layers", "1", script=script)
    local, logged = ([[json.loads(line) for line in (tmp_path / f"{kind}{r}.jsonl").read_text().splitlines()]
                      for r in range(2)] for kind in ("local", "logged"))
    assert len(local[0]) == len(logged[0]) == len(logged[1]) == 3
    assert local[0] != local[1]  # the ranks routed different rows
    mean = (torch.tensor(local[0]) + torch.tensor(local[1])) / 2
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(logged[rank]), mean, msg=f"rank {rank}")


# Each rank's routers' running thresholds as a calibration finds them (before it folds in its batch), one line a call.
THRESHOLD_RECORDER = """
import json, os, sys

from hydra_lm.cli import main
from hydra_lm.model.routing import ExpertChoiceRouter

calibrate = ExpertChoiceRouter.calibrate


def recording(self, r, k):
    with open(os.path.join(os.environ["THRESHOLD_DIR"], f"thresholds{os.environ['RANK']}.jsonl"), "a") as f:
        f.write(json.dumps([float(self.threshold_sum), float(self.threshold_weight)]) + "\\n")
    return calibrate(self, r, k)


ExpertChoiceRouter.calibrate = recording
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_the_routers_thresholds_are_the_same_on_every_rank_after_each_step(tiny_data, tmp_path, monkeypatch):
    """Each rank calibrates on its own rows; FSDP2 leaves buffers alone, so the thresholds drifted apart, the causal
    evaluation summed ranks that routed by different ones, and the checkpoint kept one rank's. Each step's
    all-reduce now averages them: every calibration starts from the same values on every rank."""
    script = tmp_path / "record_thresholds.py"
    script.write_text(THRESHOLD_RECORDER)
    monkeypatch.setenv("THRESHOLD_DIR", str(tmp_path))
    torchrun(tiny_data, tmp_path / "run", "--grad_accum", "1", "--max_steps", "3", "--eval_every", "0",
             "--no-eval_at_start", "--parallel", "fsdp", script=script)
    seen = [[json.loads(line) for line in (tmp_path / f"thresholds{r}.jsonl").read_text().splitlines()]
            for r in range(2)]
    assert len(seen[0]) == len(seen[1]) > 0 and any(s != 0 for s, _ in seen[0][-4:])
    torch.testing.assert_close(torch.tensor(seen[0]), torch.tensor(seen[1]), rtol=1e-6, atol=0)


# Rank 1 trains into a directory of its own, as on a node whose --out is a local disk.
LOCAL_OUT = """
import os, sys

from hydra_lm.cli import main

args = sys.argv[1:]
if os.environ["RANK"] == "1":
    args[args.index("--out") + 1] += "_rank1"
sys.exit(main(args))
"""


@pytest.mark.slow
def test_an_out_directory_that_some_rank_does_not_share_is_refused_at_start_up(tiny_data, tmp_path):
    script = tmp_path / "local_out.py"
    script.write_text(LOCAL_OUT)
    proc = torchrun(tiny_data, tmp_path / "run", "--max_steps", "2", script=script, check=False)
    assert proc.returncode != 0
    assert "is not the same directory on every rank" in proc.stdout + proc.stderr
    assert not list((tmp_path / "run").glob("checkpoints/*"))


# A fingerprint of the RNG state each training MoE forward draws its router jitter from, one line per call.
RNG_RECORDER = """
import hashlib, os, sys

import torch
from torch._subclasses.fake_tensor import FakeTensor

from hydra_lm.cli import main
from hydra_lm.model.moe import MoEFeedForward

forward = MoEFeedForward.forward


def recording(self, *args, **kwargs):
    if self.training and not isinstance(args[0], FakeTensor):  # not the start-up memory estimate's forward
        with open(os.path.join(os.environ["RNG_DIR"], f"rng{os.environ['RANK']}.txt"), "a") as f:
            f.write(hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest() + "\\n")
    return forward(self, *args, **kwargs)


MoEFeedForward.forward = recording
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_each_rank_draws_its_own_router_jitter(tiny_data, tmp_path, monkeypatch):
    """Every rank seeds alike to initialise the same weights; afterwards the MoE router jitter must differ between
    ranks (identical noise on every rank would be one draw, not world_size)."""
    script = tmp_path / "record_rng.py"
    script.write_text(RNG_RECORDER)
    monkeypatch.setenv("RNG_DIR", str(tmp_path))
    torchrun(tiny_data, tmp_path / "run", "--grad_accum", "1", "--max_steps", "2", "--eval_every", "0",
             "--no-eval_at_start", "--moe", "--moe_num_experts", "4", "--moe_num_layers", "1", script=script)
    states = [(tmp_path / f"rng{r}.txt").read_text().splitlines() for r in range(2)]
    assert len(states[0]) == len(states[1]) >= 2
    assert not set(states[0]) & set(states[1])


@pytest.mark.slow
def test_resume_on_one_process_restores_model_and_optimizer(tiny_data, tmp_path):
    run = tmp_path / "run"
    torchrun(tiny_data, run, "--grad_accum", "1", "--stop_at_step", "3")
    ckpt = verify(run / "checkpoints" / "hydra_debug_step3")
    # torch's own converter, independent of our loading code, is the reference.
    dcp_to_torch_save(ckpt.path / "dcp", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    trainer = Trainer(setup_run({"out": str(run), "grad_accum": 2}, echo=False))
    try:
        assert trainer.step == 3
        model_sd = trainer.model.state_dict()
        for name, value in full["model"].items():
            assert torch.equal(model_sd[name], value), name
        opt = get_optimizer_state_dict(trainer.model, trainer.optimizer)["state"]
        assert set(opt) == set(full["optim"]["state"])  # no state invented for never-updated routers
        for name, entry in full["optim"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(opt[name][key], value), (name, key)
    finally:
        trainer.s.log.close()
        trainer.loader.close()


@pytest.mark.slow
def test_export_writes_one_file_that_evaluates_like_the_sharded_checkpoint(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    torchrun(tiny_data, run, "--grad_accum", "1", "--max_steps", "2", "--save_every", "2", "--eval_every", "0")
    exported = tmp_path / "model.safetensors"
    assert main(["export", "--run", str(run), "--out", str(exported)]) == 0
    results = []
    for extra in ([], ["--checkpoint", str(exported)]):
        capsys.readouterr()
        assert main(["eval", "--run", str(run), "--json", "--device", "cpu", *extra]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["step"] == results[1]["step"] == 2
    assert results[0]["val_loss_causal"] == results[1]["val_loss_causal"]
    assert main(["generate", "--run", str(run), "--checkpoint", str(exported), "--prompt", "the", "--max_new_tokens",
                 "4"]) == 0


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two_ranks(tiny_data, tmp_path, reference):
    run = tmp_path / "run"
    single(tiny_data, run, "--grad_accum", "2", "--stop_at_step", "3")
    proc = torchrun(tiny_data, run, "--grad_accum", "1")
    assert "written by 1 process(es), this run has 2" in proc.stderr
    assert "rows against the checkpoint's" not in proc.stderr  # 2 ranks x accumulation 1 keep its 2 x 1 rows
    assert_close(train_losses(run), reference(2))


def test_a_resume_on_another_world_size_names_the_accumulation_that_keeps_the_step_rows():
    from types import SimpleNamespace

    from hydra_lm.train.resume import _global_batch_advice
    run = SimpleNamespace(cfg=SimpleNamespace(batch_size=4, grad_accum=2), dist=SimpleNamespace(world_size=4))
    assert "takes 32 rows against the checkpoint's 16" in _global_batch_advice(
        {"batch_size": 4, "grad_accum": 4}, 1, run)
    assert "--grad_accum 1 keeps it" in _global_batch_advice({"batch_size": 4, "grad_accum": 4}, 1, run)
    assert "no --grad_accum keeps it" in _global_batch_advice({"batch_size": 4, "grad_accum": 3}, 2, run)
    assert _global_batch_advice({"batch_size": 4, "grad_accum": 8}, 1, run) == ""


@pytest.mark.slow
def test_a_failing_rank_names_itself(tmp_path):
    # torchrun stops the other ranks once one fails, so which ranks get to print is a race.
    proc = torchrun(tmp_path / "no-data", tmp_path / "run", check=False)
    assert proc.returncode != 0
    assert re.search(r"hydra-lm train: \[rank [01]\] error: data directory \S*no-data", proc.stderr), proc.stderr


@pytest.mark.slow
def test_ctrl_c_under_torchrun_saves_one_sharded_checkpoint(tiny_data, tmp_path):
    """The terminal's SIGINT reaches torchrun and every worker (and torchrun forwards it again):
    all ranks stop after the same step and write one complete checkpoint."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hydra_lm",
           "train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--max_steps", "100000", "--log_every",
           "1", "--no-eval_at_start", "--save_every", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        metrics, deadline = run / "metrics.jsonl", time.time() + 300
        while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "interrupted by SIGINT" in out, out[-3000:]
    saved = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("hydra_debug_step")]
    assert len(saved) == 1
    ckpt = verify(saved[0])
    assert ckpt.layout == "dcp" and ckpt.step == train_losses(run)[-1][0] >= 3

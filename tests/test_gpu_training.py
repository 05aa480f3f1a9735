"""The trainer on a GPU (`python -m pytest -q -m gpu`; skipped elsewhere): by default it
compiles the routed units, replays the whole step as CUDA graphs and fuses the loss, and gives the
eager trainer's numbers; `--cuda_graph` alone does too, across grad accumulation, clipping,
evaluation, a curriculum switch (re-capture) and a resume that continues the uninterrupted run's losses (to
a relative 1e-5: some of cuBLAS's and inductor's kernels are not bitwise deterministic; the CPU tests require
equality)."""

import gc

import pytest
import torch

from hydra_lm.cli import main
from support import TINY_RUN, records

pytestmark = pytest.mark.gpu

GPU_RUN = ["cuda" if a == "cpu" else a for a in TINY_RUN]
# MoD from the first step, MoR switched on at step 4 of 10: the graphs are captured twice.
BASE = ["--max_steps", "10", "--log_every", "1", "--no-eval_at_start", "--eval_every", "5", "--save_every", "3",
        "--grad_accum", "2", "--mod_enable_pct", "0", "--mod_force_enable_pct", "0", "--mor_enable_pct", "0.4",
        *GPU_RUN]
COMMON = [*BASE, "--chunked_ce"]
EAGER = ["--no-compile", "--no-cuda_graph"]


def train(data, run, *extra):
    return main(["train", "--data", str(data), "--out", str(run), *COMMON, *extra])


def losses(run):
    return [(r["step"], r["loss"], r["grad_norm"], r["mor_active"]) for r in records(run, "train")]


def close(a, b, rel):
    assert [r[0] for r in a] == [r[0] for r in b] and [r[3] for r in a] == [r[3] for r in b]
    assert [r[1] for r in a] == pytest.approx([r[1] for r in b], rel=rel)
    assert [r[2] for r in a] == pytest.approx([r[2] for r in b], rel=rel)


def graphs_match_eager_and_resume(data, tmp_path, opt, log_says=""):
    """The graphed trainer with ``opt`` gives the eager trainer's losses and gradient norms through the MoR
    switch's re-capture, and a run stopped at step 6 and resumed gives the uninterrupted run's."""
    assert train(data, tmp_path / "eager", *EAGER, *opt) == 0
    assert train(data, tmp_path / "graph", *opt) == 0
    close(losses(tmp_path / "graph"), losses(tmp_path / "eager"), rel=1e-3)
    log = (tmp_path / "graph" / "train.log").read_text()
    assert log_says in log and log.count("captured as CUDA graphs") == 2, log
    pieces = tmp_path / "pieces"
    assert train(data, pieces, *opt, "--stop_at_step", "6") == 0
    assert main(["train", "--out", str(pieces)]) == 0
    close(losses(pieces), losses(tmp_path / "graph"), rel=1e-5)


def test_default_training_on_cuda_is_the_fast_path_with_the_eager_numbers(tiny_data, tmp_path):
    torch._dynamo.reset()
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "default"), *BASE]) == 0
    assert train(tiny_data, tmp_path / "eager", *EAGER) == 0
    log = (tmp_path / "default" / "train.log").read_text()
    assert "torch.compile (blocks for training, routed units for evaluation)" in log, log
    assert "whole-step CUDA graphs" in log, log
    assert "fused chunked loss" in log and log.count("captured as CUDA graphs") == 2, log
    # helper processes compiled the block layouts before the first step, and the new ones after the MoR switch
    assert log.count("parallel compile: 2 block layouts compiled in parallel processes") == 2, log
    # compiled bf16 kernels (atomic adds in the backward) drift from eager by ~1e-3 over 10 steps
    close(losses(tmp_path / "default"), losses(tmp_path / "eager"), rel=1e-2)


# Failed from the eighteenth to the sixtieth session: torch 2.11 could not lower flex inside units compiled with
# dynamic token counts ("convert FlexibleLayout to FixedLayout first"), which evaluation runs; those units take the
# dense mask since the sixty-first session, and the test passed on an H100 in the sixty-second.
def test_flex_document_masks_in_the_default_fast_path_give_the_dense_masks_numbers(tiny_data, tmp_path):
    """The trainer's default path (compiled units, whole-step CUDA graphs) with flex's block masks built
    inside the captured graphs: the dense mask's losses and gradient norms (that each replay rebuilds
    the mask from the new batch's documents: tests/test_gpu.py)."""
    for backend in ("sdpa", "flex"):
        torch._dynamo.reset()
        run = tmp_path / backend
        # width 128: two heads of 16 dimensions in the latent (the compiled flex kernel takes no smaller
        # head; with one head of 16 at width 64 flex failed to lower, eighteenth session)
        assert main(["train", "--data", str(tiny_data), "--out", str(run), *BASE, "--model.dim", "128",
                     "--model.doc_mask_backend", backend]) == 0
        assert "whole-step CUDA graphs" in (run / "train.log").read_text()
    close(losses(tmp_path / "flex"), losses(tmp_path / "sdpa"), rel=1e-2)


def test_cuda_graph_trainer_matches_the_eager_trainer_and_resumes(tiny_data, tmp_path):
    assert train(tiny_data, tmp_path / "eager", *EAGER) == 0
    assert train(tiny_data, tmp_path / "graph", "--no-compile", "--cuda_graph") == 0
    close(losses(tmp_path / "graph"), losses(tmp_path / "eager"), rel=1e-3)
    log = (tmp_path / "graph" / "train.log").read_text()
    assert "whole-step CUDA graphs" in log
    # captured after the warm-up steps, and again after the MoR switch changed the step's control flow
    assert log.count("captured as CUDA graphs") == 2, log
    assert [r["mor_active"] for r in records(tmp_path / "graph", "train")].count(True) == 6

    pieces = tmp_path / "pieces"
    assert train(tiny_data, pieces, "--no-compile", "--cuda_graph", "--stop_at_step", "6") == 0
    assert main(["train", "--out", str(pieces)]) == 0  # the saved config keeps --no-compile --cuda_graph
    close(losses(pieces), losses(tmp_path / "graph"), rel=1e-5)
    # a graph-captured run's checkpoint also resumes without graphs (portable optimizer state)
    assert main(["train", "--out", str(pieces), "--no-cuda_graph", "--max_steps", "12"]) == 0
    assert [r["step"] for r in records(pieces, "train")][-2:] == [11, 12]


def test_cuda_graph_with_compilation_matches_the_same_compilation(tiny_data, tmp_path):
    torch._dynamo.reset()
    assert train(tiny_data, tmp_path / "compiled", "--compile", "--no-cuda_graph") == 0
    torch._dynamo.reset()  # the second run's modules would recompile the first run's graphs
    assert train(tiny_data, tmp_path / "graph", "--compile", "--cuda_graph") == 0
    # Compiled bf16 backward kernels add with atomics, so two runs drift apart by a few 1e-4 over 10
    # steps; stale inputs or a missing update would put them percents apart.
    close(losses(tmp_path / "graph"), losses(tmp_path / "compiled"), rel=3e-3)
    log = (tmp_path / "graph" / "train.log").read_text()
    assert "routed units" in log and log.count("captured as CUDA graphs") == 2


def test_muon_replays_the_whole_step_as_cuda_graphs(tiny_data, tmp_path):
    """Muon (train/muon.py) and the AdamW beside it step inside the update graph, with the scheduled LR
    read from a device tensor: the eager trainer's losses, and a resume to 1e-5."""
    graphs_match_eager_and_resume(tiny_data, tmp_path, ["--no-compile", "--optimizer", "muon"],
                                  "whole-step CUDA graphs")


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sophia"])
def test_a_step_of_one_micro_batch_replays_a_backward_that_writes_the_gradients(tiny_data, tmp_path, optimizer):
    """With one micro-batch per step the gradients are None when the forward + backward is captured,
    so each replay writes them (shared weights' later uses add): the eager trainer's losses and
    gradient norms through a re-capture (the MoR switch), with the update captured (AdamW, Muon) or
    eager beside an eager Hessian pass that accumulates into the zeroed gradients (Sophia-G), and a
    resume to 1e-5."""
    graphs_match_eager_and_resume(tiny_data, tmp_path, ["--no-compile", "--optimizer", optimizer, "--grad_accum", "1"])


@pytest.mark.parametrize("optimizer", ["lion", "adafactor", "sophia"])
def test_an_optimizer_that_cannot_be_captured_steps_eagerly_between_graph_replays(tiny_data, tmp_path, optimizer):
    """By default on CUDA the forward + backward replays as a CUDA graph whatever the optimizer; one
    that cannot be captured steps eagerly on the gradients the graph wrote: the eager trainer's losses
    and gradient norms, and a resume to 1e-5."""
    graphs_match_eager_and_resume(tiny_data, tmp_path, ["--no-compile", "--optimizer", optimizer],
                                  "CUDA graphs of forward + backward (the optimizer steps eagerly)")


def test_each_run_reports_its_own_peak_memory_when_one_process_trains_several(tiny_data, tmp_path):
    """`hydra-lm compare` trains its variants in one process: a small run after a large one reports
    what it reports alone, not the large one's peak (nor the MFU probe's matrices)."""
    big = ["--batch_size", "64", "--model.dim", "256"]
    # What earlier tests of this process still hold counts in every run's peak (about 0.9 GB after the
    # decode tests; a tiny run alone peaks at about 70 MB), and the first run of a process keeps allocations
    # that later runs find made (24 MB on an H100, seventieth session): a first run takes them, and each run's
    # peak is counted from what was allocated just before it.
    assert train(tiny_data, tmp_path / "first", *EAGER) == 0
    peak = {}
    for name, extra in (("alone", ()), ("big", big), ("after", ())):
        gc.collect()
        base = torch.cuda.memory_allocated() / 2**20
        assert train(tiny_data, tmp_path / name, *EAGER, *extra) == 0
        peak[name] = max(r["memory_mb"] for r in records(tmp_path / name, "train")) - base
    assert peak["big"] > 1.3 * peak["alone"], peak
    assert peak["after"] == pytest.approx(peak["alone"], abs=0.2 * (peak["big"] - peak["alone"])), peak


def test_compare_compiles_many_routed_variants_in_one_process(tiny_data, tmp_path):
    """Each variant is a new model but the compiled routed unit is one function: the graphs of earlier
    variants (and geometric MoR depths of one token per row) must not exhaust Dynamo's recompile limit."""
    variants = [f"--variant=c{i}:mor_capacity={c},mod_capacity={m}"
                for i, (c, m) in enumerate([(0.5, 0.5), (0.25, 0.5), (0.125, 0.25), (0.0625, 0.125), (0.03, 0.5)])]
    code = main(["compare", "--data", str(tiny_data), "--out", str(tmp_path / "cmp"), *GPU_RUN, "--budget",
                 "tokens=1536", "--evals", "1", "--experimental_skip_pretest", *variants])
    assert code == 0
    assert all(records(tmp_path / "cmp" / "runs" / f"c{i}", "eval") for i in range(5))


def test_fp8_training_converts_the_layers_and_follows_the_bf16_run(tiny_data, tmp_path):
    """--experimental_fp8 on the default fast path (compiled units, CUDA graphs): torchao's float8
    Linear layers in every transformer layer, losses within a few percent of the bf16 run's. The gate at
    64 tokens runs the whole batch's calls (128 tokens) in float8 and the routed depths' in bf16."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("float8 matmuls need compute capability 9.0 (Hopper)")
    torch._dynamo.reset()
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "bf16"), *BASE]) == 0
    torch._dynamo.reset()
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "fp8"), *BASE, "--experimental_fp8",
                 "--fp8_min_tokens", "64"]) == 0
    log = (tmp_path / "fp8" / "train.log").read_text()
    assert ("now train in float8 (e4m3 forward and output gradients, rowwise_with_gw_hp scaling) on calls of at "
            "least 64 tokens" in log
            and "whole-step" in log), log
    fp8, bf16 = losses(tmp_path / "fp8"), losses(tmp_path / "bf16")
    assert all(torch.isfinite(torch.tensor([r[1] for r in fp8])))
    assert [r[1] for r in fp8] == pytest.approx([r[1] for r in bf16], rel=0.05)


def test_a_run_left_to_the_size_table_trains_in_the_micro_batch_that_fits_the_gpu(tiny_data, tmp_path):
    """The 100M table's 32 x 4 sequences per step, in one micro-batch of 128 (at 32 tokens it fits any GPU)."""
    import json

    run = tmp_path / "fit"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), "--model_size", "100M", "--seq_len", "32",
                 "--max_steps", "2", "--log_every", "1", "--no-eval_at_start", "--eval_batches", "1"]) == 0
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["batch_size"], saved["grad_accum"]) == (128, 1)
    assert "micro-batch fitted to the GPU: 128 x 32 x accumulation 1 (the 100M table's 32 x 4" in \
        (run / "train.log").read_text()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_rollback_under_whole_step_graphs_recaptures_and_trains_on(tiny_data, tmp_path, monkeypatch, optimizer):
    """A divergence rolls back into the live optimizer: its captured update must still read device-tensor LRs
    (a checkpoint holds portable floats), so the recapture after the rollback succeeds and training goes on."""
    from hydra_lm.train.divergence import FiniteFlag

    run, read, failed = tmp_path / "run", FiniteFlag.read, []

    def read_once_unhealthy(self):  # the first health check after the step-3 checkpoint reports a non-finite loss
        if not failed and (run / "checkpoints" / "hydra_debug_step3").is_dir():
            failed.append(1)
            return False
        return read(self)

    monkeypatch.setattr(FiniteFlag, "read", read_once_unhealthy)
    assert train(tiny_data, run, "--no-compile", "--optimizer", optimizer, "--max_steps", "14") == 0
    assert [r["action"] for r in records(run, "divergence")] == ["rollback"]
    steps = [r["step"] for r in records(run, "train")]
    assert steps[-1] == 14 and "captured as CUDA graphs" in (run / "train.log").read_text()

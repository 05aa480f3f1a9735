"""Block layouts compiled in helper processes before a training step (train/parallel_compile.py): the step must load
every graph the helpers compiled, a warmed step must not start helpers again, and anything the helpers cannot
reproduce must be left to the step. Both rest on the on-disk caches, AOTAutograd's included: a second run loads its
block graphs without tracing them again (the compile policy lets their custom autograd functions into that cache)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from hydra_lm import create_model
from hydra_lm.train import parallel_compile
from hydra_lm.train.compile_policy import SpeedPlan, apply_speed_plan
from hydra_lm.train.memory_estimate import MB, compute_memory_footprint
from support import TINY_RUN, records

PLAN = SpeedPlan("units", False, "naive", 4096, parallel_compile=True)


def _compiled_model(**overrides):
    model = create_model("debug", dim=64, vocab_size=256, **overrides).train()
    apply_speed_plan(model, model, PLAN)  # compiles lazily: nothing is compiled until a forward
    return model


def test_block_layouts_group_the_blocks_that_share_a_graph():
    model = _compiled_model(n_blocks=4, mod_every=2)
    routed = [i for i, b in enumerate(model.blocks) if b.routers and 0 in next(iter(b.routers.values())).depths]
    assert sorted(parallel_compile.block_layouts(model)) == sorted([[0, 2], [1, 3]]) and routed == [1, 3]
    model.blocks[3].mod_active = False  # a curriculum switch gives that block a graph of its own
    assert sorted(parallel_compile.block_layouts(model)) == [[0, 2], [1], [3]]
    model.blocks[2].mor_ramp = 0.5  # a ramp in progress runs compiled units, not a block graph
    assert sorted(parallel_compile.block_layouts(model)) == [[0], [1], [3]]
    dense = _compiled_model(arch="dense")
    assert parallel_compile.block_layouts(dense) == []


def _inputs():
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "targets": torch.roll(ids, -1, 1)}


def test_a_model_without_block_graphs_starts_no_helper_and_says_nothing(monkeypatch):
    monkeypatch.setattr(parallel_compile, "_helper_command", lambda *a: pytest.fail("a helper was started"))
    dense = _compiled_model(arch="dense")  # the default on CUDA for every model: no log line for a dense one
    assert parallel_compile.start_warming(dense, PLAN, _inputs(), torch.device("cpu"), None).wait() == ""


def test_a_model_its_config_does_not_build_is_left_to_the_step(monkeypatch):
    model = _compiled_model()
    model.blocks[0].layers[0].mlp = nn.Identity()  # e.g. layers another library converted
    monkeypatch.setattr(parallel_compile, "_helper_command", lambda *a: pytest.fail("a helper was started"))
    note = parallel_compile.start_warming(model, PLAN, _inputs(), torch.device("cpu"), None).wait()
    assert note.startswith("skipped (the model is not what its config builds")


def test_a_failing_helper_warns_and_marks_nothing_warm(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    broke = "import sys; sys.exit('helper ' + sys.stdin.readline().split()[0] + ' broke')"  # its job: LAYOUT SPEC
    monkeypatch.setattr(parallel_compile, "_helper_command", lambda: [sys.executable, "-c", broke])
    model = _compiled_model()
    for _ in range(2):  # no marker after a failure: the second call tries again
        with pytest.warns(UserWarning, match="helper 1 broke"):
            note = parallel_compile.start_warming(model, PLAN, _inputs(), torch.device("cpu"), None).wait()
        assert note.startswith("0 of 2 block layouts")


# A process of its own (inductor's and Dynamo's in-process state are then fresh, as in a new run): the trainer's step
# on the CPU, then the counters of the FX graph cache and AOTAutograd's cache for the step's own compiles.
_STEP = textwrap.dedent("""
    import torch
    from torch._dynamo.utils import counters
    from hydra_lm import create_model
    from hydra_lm.train.compile_policy import SpeedPlan, apply_speed_plan
    from hydra_lm.train.step import TrainStep

    if AHEAD:  # started before the model exists, as the trainer and the bench start them
        from hydra_lm.train import parallel_compile
        parallel_compile.start_helpers()
        def late():
            raise AssertionError("the step started a helper of its own")
        parallel_compile._launch = late
    torch.manual_seed(0)
    model = create_model("debug", dim=64, vocab_size=256).train()
    plan = SpeedPlan("units", False, "naive", 4096, parallel_compile=True)
    step = TrainStep(model, apply_speed_plan(model, model, plan), torch.optim.AdamW(model.parameters()),
                     torch.device("cpu"), plan)
    step.report = lambda note: print("NOTE", note)
    ids = torch.randint(0, 256, (2, 32))
    doc = (torch.arange(32) >= 12).long().expand(2, 32)
    step.micro({"input_ids": ids, "targets": torch.roll(ids, -1, 1), "doc_ids": doc})
    c, a = counters["inductor"], counters["aot_autograd"]
    print("CACHE", c["fxgraph_cache_hit"], c["fxgraph_cache_miss"], a["autograd_cache_hit"], a["autograd_cache_miss"],
          a["autograd_cache_bypass"])
""")


def _run_step(cache_dir, ahead: bool = False) -> tuple[str, tuple[int, ...]]:
    """What the step reported, and (FX hits, FX misses, AOTAutograd hits, misses, bypasses). ``ahead``: the helpers
    started ahead of the step (``start_helpers``)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    env.pop("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", None)  # the policy's own setting, not the shell's
    code = _STEP.replace("AHEAD", str(ahead))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    note = next((line for line in lines if line.startswith("NOTE")), "")
    counts = next(line for line in lines if line.startswith("CACHE")).split()[1:]
    return note, tuple(map(int, counts))


def test_the_step_loads_every_block_graph_the_helpers_compiled(tmp_path):
    note, counts = _run_step(tmp_path, ahead=True)
    assert "2 block layouts compiled in parallel processes" in note
    # two layouts, forward and backward, all compiled by the helpers: inductor's 4 graphs and AOTAutograd's 2
    # traced and partitioned pairs are loaded, nothing is compiled
    assert counts == (4, 0, 2, 0, 0)
    # a second run loads the same graphs without tracing them again (AOTAutograd's cache admits the blocks' custom
    # autograd functions, none bypasses it), and starts no helper
    note, counts = _run_step(tmp_path)
    assert "skipped (the caches hold this step's graphs)" in note and counts == (4, 0, 2, 0, 0)


def _job_echo() -> list[str]:
    """A helper that fails with its job and the cache directory it was started under (none: it exits cleanly)."""
    code = ("import os, sys; job = sys.stdin.readline().split(); "
            "sys.exit(f'helper {job[0]} in {os.environ[\"TORCHINDUCTOR_CACHE_DIR\"]}' if job else 0)")
    return [sys.executable, "-c", code]


def test_helpers_started_ahead_that_the_step_does_not_need_exit(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(parallel_compile, "_helper_command", _job_echo)
    parallel_compile.start_helpers(2)
    helpers = [process for process, _ in parallel_compile._ready]
    dense = _compiled_model(arch="dense")  # no block graphs: no job for them
    assert parallel_compile.start_warming(dense, PLAN, _inputs(), torch.device("cpu"), None).wait() == ""
    assert parallel_compile._ready == [] and [h.wait(timeout=60) for h in helpers] == [0, 0]


def test_a_run_that_ends_lets_its_helpers_started_ahead_go(monkeypatch, tmp_path):
    from hydra_lm.train.step import TrainStep

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(parallel_compile, "_helper_command", _job_echo)
    parallel_compile.start_helpers(2)
    helpers = [process for process, _ in parallel_compile._ready]
    model = _compiled_model()
    step = TrainStep(model, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), PLAN)
    step.stop_warming()  # the trainer's last act, also when it ends before its first step
    assert parallel_compile._ready == [] and [h.wait(timeout=60) for h in helpers] == [0, 0]


def test_helpers_started_under_another_cache_directory_are_not_given_the_step(monkeypatch, tmp_path):
    monkeypatch.setattr(parallel_compile, "_helper_command", _job_echo)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    parallel_compile.start_helpers(2)
    before = [process for process, _ in parallel_compile._ready]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "now"))  # where the step will look for the graphs
    with pytest.warns(UserWarning, match=f"helper 1 in {tmp_path / 'now'}"):
        parallel_compile.start_warming(_compiled_model(), PLAN, _inputs(), torch.device("cpu"), None).wait()
    assert [h.wait(timeout=60) for h in before] == [0, 0]  # let go without a job


def test_a_wait_that_is_interrupted_kills_the_helpers_still_running(monkeypatch, tmp_path):
    """A second stop signal (KeyboardInterrupt) or an error while the step waits: no helper outlives it."""
    import tempfile

    helpers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    warming = parallel_compile.Warming(layouts=[[0], [1]], marker=tmp_path / "marker",
                                       helpers=[(h, tempfile.TemporaryFile("w+")) for h in helpers])
    real_wait = subprocess.Popen.wait
    calls = []

    def interrupted(self, timeout=None):
        calls.append(self)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        warming.wait()
    assert all(h.poll() is not None for h in helpers) and warming.helpers == []


def test_a_helper_killed_by_a_signal_is_reported_so_in_the_runs_log(monkeypatch, tmp_path):
    """The last line a killed helper wrote is not why it failed (here a warning it printed); the step's note, which
    goes to the run's log, says which layouts the step compiles itself and why."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    killed = ("import os, sys; sys.stderr.write('UserWarning: something harmless\\n'); sys.stderr.flush(); "
              "os.kill(os.getpid(), 9)")
    monkeypatch.setattr(parallel_compile, "_helper_command", lambda: [sys.executable, "-c", killed])
    with pytest.warns(UserWarning, match="killed by SIGKILL"):
        note = parallel_compile.start_warming(_compiled_model(), PLAN, _inputs(), torch.device("cpu"), None).wait()
    assert note.startswith("0 of 2 block layouts") and "the step compiles the rest itself" in note
    assert "killed by SIGKILL" in note and "harmless" not in note


def test_helpers_started_ahead_survive_unrelated_changes_to_the_environment(monkeypatch, tmp_path):
    """A run's set-up sets variables of its own after the helpers started (W&B its service address): they stay the
    step's; a variable the compile reads (the cache directory, above) does not."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(parallel_compile, "_helper_command", _job_echo)
    parallel_compile.start_helpers(2)
    ready = [process for process, _ in parallel_compile._ready]
    monkeypatch.setenv("WANDB_SERVICE", "2-1234-tcp-localhost-5678")
    with pytest.warns(UserWarning, match=f"helper 1 in {tmp_path}"):
        parallel_compile.start_warming(_compiled_model(), PLAN, _inputs(), torch.device("cpu"), None).wait()
    assert [h.returncode for h in ready] == [1, 1]  # they got the step's jobs (and failed with them, as stubbed)


def test_a_helper_whose_parent_dies_exits(tmp_path):
    """A run killed outright (SIGKILL, or its own exit after a stop signal's grace) cannot stop helpers that have their
    job: they notice their parent gone and exit instead of compiling for nobody."""
    helper = ("from hydra_lm.train import parallel_compile as pc; import time; "
              "pc._helper = lambda path, layout: (print('compiling', flush=True), time.sleep(600)); pc._serve()")
    parent = textwrap.dedent(f"""
        import os, subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", {helper!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        p.stdin.write("0 spec\\n"); p.stdin.flush()
        print(p.pid, p.stdout.readline().strip(), flush=True)  # once it has its job
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pid, said = out.stdout.split()
    pid = int(pid)
    assert said == "compiling"

    def running() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    import time
    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.5)
    still = running()
    if still:
        os.kill(pid, 9)
    assert not still


def test_helpers_are_told_the_steps_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # a bare "cuda" means this process's device
    assert parallel_compile._indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert parallel_compile._indexed(torch.device("cuda:1")) == torch.device("cuda", 1)
    assert parallel_compile._indexed(torch.device("cpu")) == torch.device("cpu")


def test_the_bench_reports_what_the_helpers_did_once_per_step_shape(monkeypatch):
    from hydra_lm.diagnostics import bench
    from hydra_lm.diagnostics.bench_options import BenchConfig
    from hydra_lm.train import step

    calls = []
    monkeypatch.setattr(step, "start_warming", lambda *args: calls.append(args) or parallel_compile.Warming(
        "2 block layouts compiled in parallel processes (1 s)"))
    cfg = BenchConfig(model_size="debug", arch="hydra", batch_size=1, seq_len=32, steps=2, warmup=1, vocab_size=256,
                      device="cpu")
    eager = SpeedPlan(None, False, "naive", 4096, parallel_compile=True)  # the helpers stubbed: no compile
    row = bench.bench_training(create_model("debug", dim=64, vocab_size=256), cfg, eager, torch.device("cpu"))
    assert row["parallel_compile"] == "parallel compile: 2 block layouts compiled in parallel processes (1 s)"
    assert len(calls) == 1  # before the first step only: the later steps have its shapes


def test_helpers_that_would_not_fit_the_gpus_free_memory_are_stopped_at_once(monkeypatch, tmp_path):
    # A CUDA run stood in for on the CPU: what the check reads of the GPU is its free memory (the estimate is the
    # trainer's, computed on fake tensors). The helpers start before the estimate, which runs while they start up.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    monkeypatch.setattr(parallel_compile, "_helper_command", lambda: sleeper)
    started = []
    popen = subprocess.Popen
    monkeypatch.setattr(parallel_compile.subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k))
                        or started[-1])
    model, cuda = _compiled_model(), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**20, 80 * 2**30))
    note = parallel_compile.start_warming(model, PLAN, _inputs(), cuda, torch.bfloat16).wait()
    assert note.startswith("skipped (2 helpers would need about") and "0.0 GB is free" in note
    assert len(started) == 2 and all(helper.poll() is not None for helper in started)  # killed, not awaited
    assert parallel_compile._short_of_gpu_memory(model, _inputs(), 2, 80 * 2**30) is None
    # Room for the two helpers but not for the work the caller does beside them (the trainer's first evaluation)
    parts = compute_memory_footprint(model, 2, 32, device="cuda")
    one = (parts["peak_mb"] - parts["optimizer_mb"] - parts["update_mb"] + parallel_compile.HELPER_OVERHEAD_MB) * MB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(2.5 * one), 80 * 2**30))
    started.clear()
    note = parallel_compile.start_warming(model, PLAN, _inputs(), cuda, torch.bfloat16, alongside=1).wait()
    assert note.startswith("skipped (2 helpers and the work beside them would need about")
    assert len(started) == 2 and all(helper.poll() is not None for helper in started)
    assert parallel_compile._short_of_gpu_memory(model, _inputs(), 2, int(2.5 * one)) is None
    started.clear()  # an estimate that fails stops the helpers too
    monkeypatch.setattr(parallel_compile, "_short_of_gpu_memory", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        parallel_compile.start_warming(model, PLAN, _inputs(), cuda, torch.bfloat16)
    assert len(started) == 2 and all(helper.poll() is not None for helper in started)


def _trainer_with_stubbed_helpers(monkeypatch, data, run_dir, *extra, events=None, fail_eval=False,
                                  room_beside_eval=True, parallel=True):
    """An eager CPU run whose speed plan asks for the parallel compile (``parallel``), the helpers stubbed: what the
    trainer started, evaluated, waited for and stopped, in order, and what its steps trained on (into ``events``)."""
    from hydra_lm.cli import main
    from hydra_lm.train import step, trainer

    events = [] if events is None else events

    class Helpers(parallel_compile.Warming):
        def wait(self):
            events.append(("wait", self))
            return "2 block layouts compiled in parallel processes (1 s)"

        def stop(self):
            events.append(("stop", self))

    def start(model, plan, inputs, device, autocast_dtype, alongside=0):
        if alongside and not room_beside_eval:
            events.append(("no room",))
            return parallel_compile.Warming("skipped (2 helpers and the work beside them would need ...)")
        warming = Helpers(helpers=[("a helper", None)])
        events.append(("start", warming, inputs["input_ids"].clone(), alongside))
        return warming

    def evaluate(*args, **kwargs):
        events.append(("eval",))
        if fail_eval:
            raise RuntimeError("the evaluation broke")
        return real_evaluate(*args, **kwargs)

    def micro(self, inputs):
        events.append(("step", inputs["input_ids"].clone()))
        return real_micro(self, inputs)

    def pretest(self):
        events.append(("pretest",))
        return real_pretest(self)

    real_evaluate, real_micro, resolve = trainer.evaluate, step.TrainStep.micro, trainer.resolve_speed_options
    real_pretest = trainer.PretestHook.before_training
    monkeypatch.setattr(step, "start_warming", start)
    monkeypatch.setattr(trainer, "start_helpers", lambda: events.append(("ahead",)))
    monkeypatch.setattr(trainer, "evaluate", evaluate)
    monkeypatch.setattr(step.TrainStep, "micro", micro)
    monkeypatch.setattr(trainer.PretestHook, "before_training", pretest)
    monkeypatch.setattr(trainer, "resolve_speed_options",
                        lambda *a, **k: dataclasses.replace(resolve(*a, **k), parallel_compile=parallel))
    main(["train", "--data", str(data), "--out", str(run_dir), *TINY_RUN, "--max_steps", "3", "--eval_every", "2",
          "--log_every", "1", *extra])
    return events


def test_the_trainer_compiles_its_first_step_beside_its_first_evaluation(monkeypatch, tiny_data, tmp_path):
    events = _trainer_with_stubbed_helpers(monkeypatch, tiny_data, tmp_path / "ahead")
    kinds = [e[0] for e in events]
    # The first step's helpers start before the evaluation at step 0, told that it runs beside them; that step waits
    # for them (no second start), and the later steps have its shapes and switches (nothing more to compile).
    # The helpers' processes start ahead, with the run's set-up; they get their job before the pretests.
    assert kinds == ["ahead", "start", "pretest", "eval", "step", "wait", "step", "eval", "step", "eval"]
    start, first, wait = events[1], events[4], events[5]
    assert start[3] == 1 and wait[1] is start[1] and torch.equal(start[2], first[1])
    # Without the evaluation the helpers still get their job before the pretests, which run beside them.
    no_eval = _trainer_with_stubbed_helpers(monkeypatch, tiny_data, tmp_path / "no_eval", "--no-eval_at_start")
    assert [e[0] for e in no_eval] == ["ahead", "start", "pretest", "step", "wait", "step", "eval", "step", "eval"]
    assert no_eval[1][3] == 1
    # Taking the first batch ahead changes nothing the run trains on: a run without the parallel compile takes none.
    plain = _trainer_with_stubbed_helpers(monkeypatch, tiny_data, tmp_path / "plain", parallel=False)
    assert [e[0] for e in plain] == ["pretest", "eval", "step", "step", "eval", "step", "eval"]
    assert all(torch.equal(a[1], b[1]) for a, b in zip([e for e in events if e[0] == "step"],
                                                        [e for e in plain if e[0] == "step"]))
    assert [r["loss"] for r in records(tmp_path / "ahead", "train")] == \
        [r["loss"] for r in records(tmp_path / "plain", "train")]


def test_helpers_started_ahead_are_stopped_when_the_run_ends_before_their_step(monkeypatch, tiny_data, tmp_path):
    events = []
    with pytest.raises(RuntimeError, match="the evaluation broke"):
        _trainer_with_stubbed_helpers(monkeypatch, tiny_data, tmp_path / "run", events=events, fail_eval=True)
    assert [e[0] for e in events] == ["ahead", "start", "pretest", "eval", "stop"] and events[4][1] is events[1][1]


def test_helpers_without_room_beside_the_first_evaluation_start_after_it(monkeypatch, tiny_data, tmp_path):
    events = _trainer_with_stubbed_helpers(monkeypatch, tiny_data, tmp_path / "run", room_beside_eval=False)
    kinds = [e[0] for e in events]
    assert kinds[:7] == ["ahead", "no room", "pretest", "eval", "step", "start", "wait"] and events[5][3] == 0


def test_a_batch_taken_ahead_is_dropped_with_the_loader_it_came_from(monkeypatch, tiny_data, tmp_path):
    # A loader replaced after the first step's batch was taken ahead (a new row length) must not hand out that
    # batch, whose rows are the old loader's length: the next batch is the new loader's.
    from hydra_lm.train import trainer

    prepare, seen = trainer.Trainer._prepare_first_step, []

    def prepare_then_switch(self):
        prepare(self)
        seen.append(self._peeked["input_ids"].shape[1])
        self.replace_loader(1)  # the schedule's second stage: rows of 32
        seen.append(self._next_batch()["input_ids"].shape[1])

    monkeypatch.setattr(trainer.Trainer, "_prepare_first_step", prepare_then_switch)
    _trainer_with_stubbed_helpers(monkeypatch, tiny_data, tmp_path / "run", "--seq_len_schedule", "16:0,32:0.9")
    assert seen == [16, 32]

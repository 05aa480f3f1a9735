"""Compiling a training step's block layouts in parallel processes before the step runs.

A compiled training step (``compile_policy.compile_units``) compiles one graph per block layout, forward and
backward, one graph after the other in one process; inductor's scheduling and code generation, single-threaded,
are most of a cold first step (the 100M preset's two layouts: about 70 s on an H100, benchmarks/BENCHMARKS.md,
sixty-fifth session). Inductor and AOTAutograd keep what they compile in on-disk caches (the FX graph cache, keyed
by the graph; AOTAutograd's cache of the traced and partitioned forward and backward; Triton's kernels and their
autotuned launch settings), so a graph another process compiled is loaded, not traced and compiled again. So
before a step with new shapes, one helper process per block layout builds the same model from its config, compiles
that layout's blocks only (the other blocks run eagerly) on the step's own batch, forward and backward, and exits;
the step then loads every layout's graphs. PyTorch has no such parallel compile of separate graphs (its compile
threads share out one graph's Triton kernels), hence this module.

On by default on CUDA (``--no-parallel_compile`` turns it off): on an H100 the 100M preset's cold first step
took 55 s (48 s of helpers, then 7 s of loading and stepping) against 68 s serially on one host, 69 s against
88-107 s on another. Each helper pays for its own process (imports, model, Dynamo's start: 8.6 s of its 48 s), so
only the AOTAutograd cache (``compile_policy.compile_units`` lets the graphs' custom autograd functions in) makes
the loading short enough to gain; on a 2-core CPU the helpers compete for the cores and it does not pay
(benchmarks/BENCHMARKS.md, forty-first, seventy-first to seventy-third sessions). The trainer and the bench start
two helpers as soon as their speed plan is known (``start_helpers``): what a helper does before its job (imports:
about 7 s on an H100 host) overlaps the run's own set-up, and the helpers wait on stdin for the step's layouts and
inputs (on one H100 the bench's cold first step took 5.3 and 5.8 s less than runs without beside them: 54.9 and
56.4 s; seventy-sixth session). The trainer gives them the first step's job before its pretests and its first
evaluation, whose own compile then runs beside theirs (``TrainStep.prepare``). The helpers are skipped where
they cannot pay or would compile the wrong graphs:

- fewer than two layouts, or a model that its config does not rebuild (e.g. layers converted to float8): the
  helpers' graphs would not be the step's;
- on a GPU whose free memory would not hold every helper at once (each holds a model and a step's activations);
- caches warmed for this very step before: after the helpers succeed a marker is written into inductor's cache
  directory under a key of everything the graphs depend on (package sources, torch and Triton versions, device,
  config, block switches, input shapes, speed plan, global backend flags). Deleting the cache deletes the
  marker; a marker whose cache entries went stale only costs the step its usual serial compile.

A helper that fails (out of memory, a crash, a signal) costs a warning and a line in the run's log saying why: the step
compiles what is missing itself. A run that stops (an error, a second stop signal) or dies kills its helpers or, dead,
leaves them to exit when they see it gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import IO

import torch

# A helper taking longer than this is killed; the step then compiles its layout itself.
HELPER_TIMEOUT_S = 900
# A helper's GPU memory beyond the step's estimate without the optimizer: its CUDA context, cuBLAS and compile
# workspaces.
HELPER_OVERHEAD_MB = 1024


def block_layouts(model) -> list[list[int]]:
    """The indices of the blocks whose training forward runs a compiled block graph, grouped by layout: what
    Dynamo specialises a block's graph on (its routers, depths, shares and curriculum switches). Two groups
    that compile to one graph only waste a helper; one group that compiles to two only leaves the second to
    the step."""
    groups: dict[tuple, list[int]] = {}
    for i, block in enumerate(model.blocks):
        if block.compiled_block is None or block.mor_ramp != 1.0:
            continue  # no block graph: its units compile inside the step, as before
        key = (block.recursions, tuple(block.depth_fractions), block.mod_active, block.mor_active,
               tuple((type(r).__name__, r.kind, tuple(r.depths)) for r in block.all_routers()),
               tuple(type(layer).__name__ for layer in block.layers))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _structure(model) -> list[tuple]:
    return [(name, type(m).__name__) for name, m in model.named_modules()] + \
           [(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()]


def _rebuilds(model) -> bool:
    """Whether ``HydraModel(model.config)`` has ``model``'s modules and parameters (checked on the meta device)."""
    from ..model.hydra import HydraModel

    with torch.device("meta"):
        replica = HydraModel(model.config)
    dtype = next(model.parameters()).dtype
    return _structure(replica.to(dtype)) == _structure(model)


# Process-wide settings that a compiled graph depends on (inductor keys its cache by the matmul ones; SDPA's enabled
# kernels decide which attention op the graph holds), as (module, attribute): the helpers take over the step's.
_GLOBAL_SETTINGS = {"matmul.fp32_precision": (torch.backends.cuda.matmul, "fp32_precision"),
                    "matmul.fp16_reduction": (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
                    "matmul.bf16_reduction": (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
                    "cudnn.conv.fp32_precision": (torch.backends.cudnn.conv, "fp32_precision"),
                    "cudnn.rnn.fp32_precision": (torch.backends.cudnn.rnn, "fp32_precision")}
_SDPA_KERNELS = ("flash", "mem_efficient", "math", "cudnn")


def _global_flags() -> dict:
    flags = {key: getattr(module, name) for key, (module, name) in _GLOBAL_SETTINGS.items()}
    return {**flags, **{f"sdpa.{k}": getattr(torch.backends.cuda, f"{k}_sdp_enabled")() for k in _SDPA_KERNELS}}


def _set_global_flags(flags: dict) -> None:
    # Only what differs: a precision set explicitly is another cache key than the same one left at its default.
    for key, (module, name) in _GLOBAL_SETTINGS.items():
        value = flags[key]
        if getattr(module, name) != value:
            setattr(module, name, value)
    for k in _SDPA_KERNELS:
        getattr(torch.backends.cuda, f"enable_{k}_sdp")(flags[f"sdpa.{k}"])


def _sources_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _marker(spec: dict) -> Path:
    from importlib.metadata import PackageNotFoundError, version

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    try:
        triton = version("triton")
    except PackageNotFoundError:
        triton = None
    device = torch.device(spec["device"])
    about = {k: v for k, v in spec.items() if k != "inputs"}
    about["inputs"] = {k: (tuple(v.shape), str(v.dtype)) for k, v in spec["inputs"].items()}
    about["versions"] = (torch.__version__, triton, _sources_digest(),
                         torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    key = hashlib.sha256(repr(sorted(about.items())).encode()).hexdigest()[:32]
    return Path(cache_dir()) / "hydra_lm_parallel_compile" / key


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a helper's "cuda" would be its own current device, not necessarily this one's."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def start_warming(model, plan, inputs: dict[str, torch.Tensor], device: torch.device,
                  autocast_dtype: torch.dtype | None, alongside: int = 0) -> Warming:
    """Start compiling ``model``'s block layouts for a step on ``inputs``, one helper process each (those started
    ahead first); ``wait`` on the result before the step. ``plan``: the run's ``SpeedPlan`` (the helpers apply it as
    the step will); ``autocast_dtype``: the step's autocast (None: none). Meanwhile the caller may do other work,
    e.g. the trainer's pretests and first evaluation; ``alongside``: how many processes of a helper's GPU memory
    that work may take (a bound on it: an evaluation holds no gradients), as the helpers start only if all of them
    fit."""
    try:
        return _start_warming(model, plan, inputs, device, autocast_dtype, alongside)
    finally:
        release_helpers()  # helpers started ahead that got no job: none idles through the run


def _start_warming(model, plan, inputs: dict[str, torch.Tensor], device: torch.device,
                   autocast_dtype: torch.dtype | None, alongside: int) -> Warming:
    from torch._inductor import config as inductor_config

    if not inductor_config.fx_graph_cache:
        return Warming("skipped (inductor's FX graph cache is off: the step could not load what helpers compiled)")
    layouts = block_layouts(model)
    if not layouts:  # no block graphs at all (a dense model, a MoR ramp in progress): nothing worth a log line
        return Warming("")
    if len(layouts) == 1:
        return Warming("skipped (1 block layout to compile)")
    if not _rebuilds(model):
        return Warming("skipped (the model is not what its config builds, e.g. converted layers)")
    spec = {"config": model.config.to_dict(), "plan": dataclasses.asdict(plan), "device": str(_indexed(device)),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "autocast": None if autocast_dtype is None else str(autocast_dtype).removeprefix("torch."),
            "switches": [(b.mod_active, b.mor_active, b.mor_ramp) for b in model.blocks], "flags": _global_flags(),
            "layouts": layouts, "inputs": {k: v.detach().cpu() for k, v in inputs.items()}}
    marker = _marker(spec)
    if marker.exists():
        return Warming("skipped (the caches hold this step's graphs)")
    free = None
    if device.type == "cuda":  # before any helper takes some; what this process caches unused goes back to the driver
        torch.cuda.empty_cache()  # for the helpers (at a later step's new shapes, the earlier steps' activations)
        free = torch.cuda.mem_get_info(device)[0]
    warming = Warming(layouts=layouts, marker=marker, tmp=tempfile.TemporaryDirectory(prefix="hydra_lm_compile_"))
    path = os.path.join(warming.tmp.name, "spec.pt")
    torch.save(spec, path)
    _release_stale()
    warming.helpers = [_ready.pop(0) if _ready else _launch() for _ in layouts]
    for i, (helper, _) in enumerate(warming.helpers):
        _give(helper, f"{i} {path}")
    # The memory estimate (1.8 s for the 100M preset on a CPU core) runs while the helpers build their models and
    # trace and compile their graphs, which takes them longer (about 25 s on an H100 before they hold
    # activations), so it costs the step nothing.
    try:
        short = None if free is None else _short_of_gpu_memory(model, inputs, len(layouts), free, alongside)
    except BaseException:
        warming.stop()  # no helper outlives a step that does not wait for it
        raise
    if short:
        warming.stop()
        return Warming(short)
    return warming


@dataclasses.dataclass
class Warming:
    """Helper processes compiling a step's block layouts (none: ``note`` says why)."""

    note: str = ""
    layouts: list[list[int]] = dataclasses.field(default_factory=list)
    helpers: list[tuple[subprocess.Popen, IO[str]]] = dataclasses.field(default_factory=list)
    marker: Path | None = None  # written once every helper succeeded
    tmp: tempfile.TemporaryDirectory | None = None  # the spec
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def wait(self) -> str:
        """Wait for the helpers; returns what happened, for the log. Interrupted (a second stop signal, an error), it
        kills the helpers still running before it lets go."""
        if not self.helpers:
            return self.note
        waited = time.perf_counter()
        failed = []
        try:
            for i, (helper, log) in enumerate(self.helpers):
                try:
                    helper.wait(timeout=max(1.0, HELPER_TIMEOUT_S - (time.perf_counter() - self.start)))
                    late = False
                except subprocess.TimeoutExpired:
                    helper.kill()
                    helper.wait()
                    late = True
                if helper.returncode != 0:
                    failed.append(f"layout {i} (blocks {self.layouts[i]}): {_failure(helper, log, late)}")
        except BaseException:
            self.stop()
            raise
        self._close()
        now = time.perf_counter()
        seconds = f"{now - self.start:.0f} s" + (f", {now - waited:.0f} s of it waited for"
                                                 if waited - self.start >= 1 else "")
        n = len(self.layouts)
        if failed:
            why = "; ".join(failed)
            warnings.warn("parallel compile: a helper process failed, so the step compiles its layout itself: " + why,
                          stacklevel=2)
            return (f"{n - len(failed)} of {n} block layouts compiled in parallel ({seconds}); the step compiles the "
                    f"rest itself: {why}")
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.touch()
        return f"{n} block layouts compiled in parallel processes ({seconds})"

    def stop(self) -> None:
        """Kill the helpers (a run that ends, or a step that will not need their graphs)."""
        for helper, _ in self.helpers:
            helper.kill()
            helper.wait()
        self._close()

    def _close(self) -> None:
        for _, log in self.helpers:
            log.close()
        self.helpers = []
        if self.tmp is not None:
            self.tmp.cleanup()


def _failure(helper: subprocess.Popen, log: IO[str], late: bool) -> str:
    """Why a helper did not succeed: timed out, killed by a signal (its last words then are not the cause), or the
    last line it wrote to stderr."""
    if late:
        return f"timed out after {HELPER_TIMEOUT_S} s"
    if helper.returncode < 0:
        return f"killed by {signal.Signals(-helper.returncode).name}"
    log.seek(0)
    err = log.read().strip()
    return err.splitlines()[-1] if err else f"exit status {helper.returncode}"


def _short_of_gpu_memory(model, inputs: dict[str, torch.Tensor], helpers: int, free: int,
                         beside: int = 0) -> str | None:
    """Why ``helpers`` helpers at once, and ``beside`` more processes of a helper's size (work the caller does
    meanwhile), would not fit the GPU's ``free`` bytes (None: they fit). A helper holds what the step holds but the
    optimizer's state (the trainer's memory estimate); out of memory, the helpers would only have cost their time
    before the step compiles alone."""
    from .memory_estimate import MB, compute_memory_footprint

    batch, seq = inputs["input_ids"].shape
    parts = compute_memory_footprint(model, batch, seq, device="cuda")
    one = (parts["peak_mb"] - parts["optimizer_mb"] - parts["update_mb"] + HELPER_OVERHEAD_MB) * MB
    need = (helpers + beside) * one
    if need <= free:
        return None
    return (f"skipped ({helpers} helpers{' and the work beside them' if beside else ''} would need about "
            f"{need / 1e9:.1f} GB of GPU memory at once, "
            f"{free / 1e9:.1f} GB is free)")


# Helpers started ahead (``start_helpers``), waiting for a job: (process, its stderr); the environment they got.
_ready: list[tuple[subprocess.Popen, IO[str]]] = []
_ready_env: dict[str, str] = {}


def start_helpers(count: int = 2) -> None:
    """Start ``count`` helpers ahead of the step that will need them, so that their imports overlap the run's own
    set-up (model, data, optimizer, evaluation). Two: the presets' block layouts (a first block that runs every
    token, routed blocks after it). The next ``start_warming`` takes them; any it does not need exit, as do all of
    them when this process ends (their stdin closes)."""
    _release_stale()
    _ready_env.update(_helper_env())
    _ready.extend(_launch() for _ in range(count - len(_ready)))


def release_helpers() -> None:
    """Let the helpers started ahead that got no job exit (an empty job)."""
    while _ready:
        helper, log = _ready.pop()
        _give(helper, "")
        log.close()
    _ready_env.clear()


# The environment a helper's compile depends on: caches, backends, devices, imports. Other variables change during a
# run's set-up (W&B's service address, say) and must not cost it the helpers started ahead.
_COMPILE_ENV = ("TORCH", "PYTORCH", "TRITON", "CUDA", "NVIDIA", "PYTHON", "LD_", "XDG_", "HOME", "USER", "TMPDIR")


def _compile_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_COMPILE_ENV)}


def _release_stale() -> None:
    if _compile_env(_ready_env) != _compile_env(_helper_env()):  # started under other settings (e.g. another cache
        release_helpers()                                          # directory): not these


def _helper_env() -> dict[str, str]:
    # The helpers import this very package, wherever this process found it.
    package_root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}


def _launch() -> tuple[subprocess.Popen, IO[str]]:
    # Errors go to a file: a pipe that fills while another helper is awaited would stall its writer.
    log = tempfile.TemporaryFile("w+")
    # A session of its own: a terminal's Ctrl-C (or a signal to the run's process group) stops the run, which then
    # stops its helpers, instead of killing them and compiling every layout itself before it can stop.
    return subprocess.Popen(_helper_command(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log,
                            env=_helper_env(), text=True, start_new_session=True), log


def _give(helper: subprocess.Popen, job: str) -> None:
    try:
        helper.stdin.write(job + "\n" if job else "")
        helper.stdin.close()
    except OSError:  # it ended before its job (e.g. a failed import): its exit status and log say why
        pass


def _helper_command() -> list[str]:
    return [sys.executable, "-m", __name__]


def _serve() -> None:
    """A helper process: import what compiling needs, then run the job its parent sends on stdin ("LAYOUT
    SPEC_PATH"; none, or the parent gone: exit). With a job, it exits as soon as its parent is gone: a parent killed
    outright (or one that gave up waiting on a stop signal) cannot stop it, and nothing would load what it
    compiles."""
    parent = os.getppid()  # before the imports: it may be gone by their end
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    from . import compile_policy  # noqa: F401

    job = sys.stdin.readline().strip()
    if job:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
        layout, path = job.split(" ", 1)
        _helper(path, int(layout))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _helper(path: str, layout: int) -> None:
    """One helper: the step's forward and backward with only the blocks of ``layout`` compiled."""
    from ..config import HydraConfig
    from ..model.hydra import HydraModel
    from .compile_policy import SpeedPlan, apply_speed_plan

    spec = torch.load(path)
    _set_global_flags(spec["flags"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with torch.device(device):  # initialised where it runs: no host-side initialisation and copy
        model = HydraModel(HydraConfig.from_dict(spec["config"]))
    model.to(device=device, dtype=getattr(torch, spec["dtype"]))
    model.train()
    for block, (mod_active, mor_active, ramp) in zip(model.blocks, spec["switches"]):
        block.mod_active, block.mor_active, block.mor_ramp = mod_active, mor_active, ramp
    apply_speed_plan(model, model, SpeedPlan(**spec["plan"]))
    mine = set(spec["layouts"][layout])
    for i, block in enumerate(model.blocks):
        if i not in mine:
            block.compiled_block = block.compiled_unit = block.compiled_select = None
    for moe in model.moe_blocks.values():  # compiled by the step itself
        moe._compiled_call_impl = None
    inputs = {k: v.to(device) for k, v in spec["inputs"].items()}
    dtype = spec["autocast"]
    with (torch.autocast(device.type, dtype=getattr(torch, dtype), cache_enabled=False) if dtype
          else contextlib.nullcontext()):
        out = model(inputs["input_ids"], targets=inputs["targets"], doc_ids=inputs.get("doc_ids"))
    out["loss"].backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    _serve()

"""Run logging: the human log (stdout + RUN_DIR/train.log), metrics.jsonl, optional TensorBoard/W&B."""

from __future__ import annotations

import json
import math
import platform
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id"
LOG_FILE = "train.log"


class RunLog:
    """Lines to stdout and to the run's log file; warnings also go to stderr."""

    def __init__(self, path: Path | None, echo: bool = True, prefix: str = ""):
        self.echo = echo
        self.prefix = prefix  # e.g. "[rank 1] " on the non-logging ranks of a multi-process run
        self._file = open(path, "a", encoding="utf-8") if path is not None else None

    def info(self, msg: str) -> None:
        if self.echo:
            print(msg, flush=True)
        self._write(msg)

    def warning(self, msg: str) -> None:
        print(f"{self.prefix}warning: {msg}", file=sys.stderr, flush=True)
        self._write(f"warning: {msg}")

    def _write(self, msg: str) -> None:
        if self._file is not None:
            self._file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def git_revision() -> str:
    src = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src, capture_output=True, text=True,
                             timeout=5)
        if rev.returncode != 0:
            return "unknown (not a git checkout)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src,
                               capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


def versions() -> dict[str, str]:
    from ..version import __version__

    out = {"hydra_lm": __version__, "python": platform.python_version(), "torch": torch.__version__,
           "platform": platform.platform()}
    for name in ("numpy", "tokenizers", "safetensors"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # a missing optional package is not worth failing a run over
            out[name] = "not installed"
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["gpu"] = torch.cuda.get_device_name()
    return out


def memory_mb(device: torch.device) -> float:
    """Peak memory: allocated GPU memory on CUDA, the process's peak RSS elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak_kb / 1024 if sys.platform != "darwin" else peak_kb / 2**20


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense matmul throughput actually reachable on this GPU (the MFU denominator), in FLOP/s."""
    if device.type != "cuda":
        return None
    n = 8192
    # Off the run's random streams: a resumed run measures after restoring them, and draws (MoE router jitter,
    # dropout-like noise) must continue as in the uninterrupted run.
    with torch.random.fork_rng(devices=[device]):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def check_logger_packages(tensorboard: bool, wandb: bool) -> None:
    """Refuse --tensorboard / --wandb without their package. Called in the run's setup, before the run files are
    written, so that a refused flag is not saved into config.json (where a plain resume would meet it again)."""
    if tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ValueError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
    if wandb:
        try:
            import wandb as wandb_mod  # noqa: F401
        except ImportError:
            raise ValueError("--wandb needs the wandb package (pip install wandb)") from None


def open_tensorboard(directory: Path, purge_step: int):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(directory), purge_step=purge_step)


class MetricsWriter:
    def __init__(self, run_dir: Path, log: RunLog, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "hydra-lm", config: dict | None = None, resume_step: int = -1):
        self.path = run_dir / METRICS_FILE
        self.log = log
        self._drop_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        self._wandb = None
        check_logger_packages(tensorboard, wandb)
        self._tb_dir = run_dir / "tensorboard"
        if tensorboard:
            # A resume redoes the steps after its checkpoint, a fresh start every step: TensorBoard hides the events
            # an earlier attempt logged from there on (its purge step), so no step shows twice.
            self._tb = open_tensorboard(self._tb_dir, purge_step=resume_step + 1 if resume_step >= 0 else 0)
        if wandb:
            import wandb as wandb_mod
            # One W&B run per training run: a resume continues the id its start recorded, a fresh start takes a new one.
            id_file = run_dir / WANDB_ID_FILE
            run_id = id_file.read_text().strip() if resume_step >= 0 and id_file.is_file() else uuid.uuid4().hex[:16]
            id_file.write_text(run_id + "\n")
            self._wandb = wandb_mod.init(project=wandb_project, dir=str(run_dir), config=config,
                                         name=run_dir.name, id=run_id, resume="allow")

    def rewind(self, step: int) -> None:
        """A rollback to the checkpoint of ``step`` redoes the steps after it: drop their measurements (train and
        eval records), so that every step's appear once, and keep the events that explain the rollback
        (anomalies, divergences, switches). TensorBoard hides its events from ``step + 1`` on; W&B takes no step
        twice, so it keeps the rolled-back steps' values and drops the redone ones (metrics.jsonl has them)."""
        self._file.close()
        self._drop_after(step, kinds=("train", "eval"))
        self._file = open(self.path, "a", encoding="utf-8")
        if self._tb is not None:
            self._tb.close()
            self._tb = open_tensorboard(self._tb_dir, purge_step=step + 1)

    def _drop_after(self, step: int, kinds: tuple[str, ...] | None = None) -> None:
        """A resumed run redoes the steps after its checkpoint; drop their old records (of ``kinds``, None: all)
        so every step appears once. A rollback to a step before the checkpoint stays: the checkpoint was written after
        it, with its lowered learning rate, which a compare of the run must still see. A fresh start (step -1) keeps
        an earlier attempt's file as metrics.jsonl.old."""
        if not self.path.is_file():
            return
        if step < 0:
            self.path.replace(self.path.with_name(self.path.name + ".old"))
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            rolled_back_before = record.get("action") == "rollback" and record.get("to_step", step) < step
            # A divergence that stopped the run explains the lower --lr its advice resumes with.
            stopped_by = record.get("kind") == "divergence" and record.get("action") == "stop"
            if record.get("step", 0) <= step or (kinds is not None and record.get("kind") not in kinds) \
                    or rolled_back_before or stopped_by:
                kept.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(finite_or_null(record)) + "\n")
        self._file.flush()
        step = record.get("step", 0)
        # Events (a divergence's window mean, an anomaly's loss) under their kind: in the training curves' own tags
        # they would read as extra training points.
        kind = record.get("kind")
        prefix = "" if kind in ("train", "eval", None) else f"{kind}/"
        numeric = {prefix + k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class NullMetrics:
    """The metrics sink of the ranks that do not log (all but rank 0)."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_line(r: dict[str, Any], max_steps: int) -> str:
    parts = [f"step {r['step']:>6}/{max_steps}", f"loss {r['loss']:.4f}", f"ce {r['ce_loss']:.4f}",
             f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.2f}", f"{r['tokens_per_s']:,.0f} tok/s",
             f"mem {r['memory_mb']:,.0f}MB"]
    if r.get("mfu") is not None:
        parts.append(f"mfu {100 * r['mfu']:.1f}%")
    if "exec_frac_mean" in r:  # routed models: the mean share of a row the routers' units ran
        parts.append(f"exec {r['exec_frac_mean']:.2f}")
    return " | ".join(parts)


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float, nested ones too (routing, expert load), as None: strict JSON readers
    (jq, browsers) reject NaN and Infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value

"""The micro-batch of a CUDA run whose batch the user left to the per-size table (and the peak estimate a CPU run
is checked against, run.py).

The table (``options.SIZE_DEFAULTS``) gives sequences per optimizer step as batch x accumulation for a
32 GB GPU, e.g. 2 x 30 for 1B. A routed model pays a fixed cost per routed unit and micro-batch
(launches, small kernels of the deep recursions), so on a larger GPU the same sequences per step train
faster in fewer, larger micro-batches (100M preset, one H100: 834,298 tokens/s at 64 sequences against
542,249 at 16, benchmarks/BENCHMARKS.md). The micro-batch here is the largest divisor of the table's
sequences per step whose estimated peak (``memory_estimate``, within 15% of measured H100
peaks) fits in ``FIT_SHARE`` of the GPU's memory; the step's tokens, and so the run's arithmetic, stay
the table's.
"""

from __future__ import annotations

from ..config import HydraConfig
from .curriculum import Curriculum, CurriculumPlan
from .memory_estimate import measure_training_memory
from .options import TrainConfig

# Share of the GPU's memory the estimated peak may take: room for the estimate's error (it was 4% under
# a measured 1B peak and 15% over a 100M one), the CUDA context, compilation and the allocator's slack.
FIT_SHARE = 0.7


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def first_step_peak_mb(cfg: TrainConfig, model_cfg: HydraConfig, batch: int, device: str) -> float:
    """Estimated peak MB of a micro-batch of ``batch`` sequences of ``cfg``'s run on ``device`` ("cuda" or "cpu"),
    in the routing of its first step: its most expensive, as routers only switch on and the MoR ramp only moves away
    from full depth (``--mod_off``, a later ``mod_enable_pct``: every token through every block for a while). Sized
    for the configured loss: the anomaly monitor switching the fused loss off mid-run is not budgeted for."""
    routing = Curriculum(CurriculumPlan.from_config(cfg)).decide(0)
    return measure_training_memory(model_cfg, batch, cfg.seq_len, cfg.optimizer, cfg.gradient_checkpointing,
                                   cfg.checkpoint_every or 1, device=device, fused_loss=cfg.chunked_ce is not False,
                                   ce_chunk_size=cfg.chunked_ce_size, curriculum=routing)["peak_mb"]


def fit_micro_batch(cfg: TrainConfig, model_cfg: HydraConfig, gpu_bytes: int) -> tuple[int, int, float]:
    """(batch, accumulation, estimated peak MB) for ``cfg``'s sequences per step on a GPU of ``gpu_bytes``:
    the largest micro-batch that fits (1 when none does), by the memory estimate of ``model_cfg`` with
    ``cfg``'s sequence length, optimizer, gradient checkpointing and loss (``first_step_peak_mb``)."""
    estimated: dict[int, float] = {}

    def peak(batch: int) -> float:
        if batch not in estimated:
            estimated[batch] = first_step_peak_mb(cfg, model_cfg, batch, "cuda")
        return estimated[batch]

    sequences = cfg.batch_size * cfg.grad_accum
    budget_mb = FIT_SHARE * gpu_bytes / 2 ** 20
    # Micro-batches that topk_groups splits into equal groups of rows (every divisor when it is 1). Runs with a
    # sequence-length schedule keep the table's batch (run.py): the fit sizes for one length.
    groups = model_cfg.topk_groups
    options = [d for d in divisors(sequences) if d % groups == 0] or [sequences]
    # The peak grows with the micro-batch: a binary search over the divisors needs a few estimates only.
    low, high, batch = 0, len(options) - 1, options[0]
    while low <= high:
        middle = (low + high) // 2
        if peak(options[middle]) <= budget_mb:
            batch, low = options[middle], middle + 1
        else:
            high = middle - 1
    return batch, sequences // batch, peak(batch)

"""Data-parallel training on torch.distributed: process group, FSDP2 / DDP wrapping, agreed decisions.

A run started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) joins the process group
(NCCL on CUDA, gloo on CPU) and wraps the model:

- ``fsdp`` (default): FSDP2 ``fully_shard`` on every recursive block and MoE layer, then on the
  root (embedding, tied head, final norm). On CUDA parameters are gathered in bf16 and gradients
  reduced in fp32; on CPU everything stays fp32.
- ``ddp``: ``DistributedDataParallel`` (full replicas, all-reduced gradients).

Every decision that changes what the next collective is (stop after a signal, the curriculum's
loss gate, the adaptive LR) is taken from values reduced across ranks at the same step, so ranks
never disagree. Hard top-k routing keeps shapes static per rank, so routing cannot change them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

PARALLEL = ("fsdp", "ddp")


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    parallel: str = "none"  # "none" for a single process, else fsdp / ddp
    control: object | None = None  # a gloo group for host-side agreement (no GPU sync)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init_distributed(device_name: str, parallel: str) -> tuple[DistInfo, torch.device | None]:
    """Join the process group when launched by torchrun; returns the info and this rank's device
    (None for a single process: the caller picks the device as usual)."""
    world = launched_world_size()
    if world <= 1:
        return DistInfo(), None
    if parallel not in PARALLEL:
        raise ValueError(f"--parallel {parallel!r}: choose one of {list(PARALLEL)}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device_name}: CUDA is not available on this machine")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): launch at "
                             "most one process per GPU (torchrun --nproc_per_node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda"
                                else None, timeout=datetime.timedelta(minutes=30))
    control = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    return DistInfo(dist.get_rank(), dist.get_world_size(), parallel, control), device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, info: DistInfo, device: torch.device, find_unused: bool) -> nn.Module:
    """The module the training step calls: the model itself after FSDP2 (which shards it in place),
    or its DDP wrapper. ``find_unused``: some parameters may get no gradient in a step (routers the
    curriculum has switched off)."""
    if not info.enabled:
        return model
    if info.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       find_unused_parameters=find_unused)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    moe = dict(getattr(model, "moe_blocks", {}).items())
    units = [u for i, block in enumerate(model.blocks) for u in (block, moe.get(str(i))) if u is not None]
    for i, unit in enumerate(units):
        # The last unit's parameters are needed again at once by backward: keep them gathered.
        fully_shard(unit, reshard_after_forward=i < len(units) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model


@contextlib.contextmanager
def gradient_sync(wrapped: nn.Module, info: DistInfo, sync: bool):
    """Accumulation: reduce gradients only on the last micro-batch of a step. FSDP2 also keeps the
    gathered parameters after the backward of an earlier micro-batch, so the next forward does
    not gather them again (full bf16 parameters stay resident during accumulation)."""
    if not info.enabled:
        yield
    elif info.parallel == "ddp":
        with contextlib.nullcontext() if sync else wrapped.no_sync():
            yield
    else:
        wrapped.set_requires_gradient_sync(sync)
        wrapped.set_reshard_after_backward(sync)
        yield


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 gradient norms, say) as an ordinary tensor; other tensors unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def mean_across_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return t


def sum_across_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True when ``flag`` is true on some rank (a host-side gloo reduction: no GPU sync)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.control)
    return bool(t.item())


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier(group=info.control)


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=info.control)
    return box[0]

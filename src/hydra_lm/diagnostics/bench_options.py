"""``hydra-lm bench``'s settings: one dataclass whose fields are the flags (the speed flags carry the
same names and automatic defaults as ``hydra-lm train``'s, see train/compile_policy.py)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..model.attention_backend import SDPA_KERNELS
from ..train.options import TrainConfig, opt

_TRAIN = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _as_train(name: str) -> Any:
    """The train flag of the same name: same default, help and type."""
    f = _TRAIN[name]
    return field(default=f.default, metadata=f.metadata)


@dataclass
class BenchConfig:
    model_size: str = opt("100M", "model preset (debug, 50M, 100M, ...)", type=str)
    arch: str = opt("both", "which archs to time, in turn", type=str, choices=("both", "hydra", "dense"))
    batch_size: int = opt(16, "sequences per step", type=int)
    seq_len: int = opt(1024, "tokens per sequence", type=int)
    steps: int = opt(20, "timed steps (median reported)", type=int)
    optimizer: str = _as_train("optimizer")
    warmup: int = opt(5, "untimed steps after the first", type=int)
    compile: bool | None = _as_train("compile")
    parallel_compile: bool | None = _as_train("parallel_compile")
    cuda_graph: bool | None = _as_train("cuda_graph")
    chunked_ce: bool | None = _as_train("chunked_ce")
    chunked_ce_size: int = _as_train("chunked_ce_size")
    ce_impl: str = _as_train("ce_impl")
    sdpa_kernel: str = opt("auto", "force one SDPA kernel (auto: PyTorch's choice)", type=str, choices=SDPA_KERNELS)
    document_masking: bool = opt(True, "pass doc_ids as the trainer does by default (documents of geometric "
                                       "length, mean 400 tokens; --no-document_masking: plain causal kernels)",
                                 type=bool)
    inference: bool = opt(False, "also time prefill and steady-state decoding", type=bool)
    new_tokens: int = opt(128, "--inference: prompt length and decode steps timed, per batch size", type=int)
    decode_batches: str = opt("1,8,32,128", "--inference: decode batch sizes, comma-separated", type=str)
    decode_compile: bool | None = opt(None, "--inference: torch.compile the decode step's routed units (one graph "
                                             "shared by all) before its CUDA graph is captured, and the prefill's "
                                             "blocks (default: on CUDA, as HydraModel.generate; "
                                             "--no-decode_compile: eager kernels)", type=bool)
    decode_device_decisions: bool | None = opt(None, "--inference: take the decode step's routing decisions on the "
                                                     "device as CUDA graph IF nodes (default: where cuda-bindings "
                                                     "can build them, as generate; --no-decode_device_decisions: "
                                                     "read them back to the host)", type=bool)
    vocab_size: int = opt(50257, "vocabulary size", type=int)
    device: str = opt("auto", "auto (cuda if available), cpu or cuda[:N]", type=str)
    json: str | None = opt(None, "also write the report here", type=str)
    routing_efficiency: bool = opt(False, "also time HYDRA with routing off: achieved speedup / FLOP-ratio speedup",
                                   type=bool)
    profile: str | None = opt(None, "after timing, profile 3 steps: kernel time by category in the report, Chrome "
                                    "traces and (CUDA) per-kernel CSV tables in this directory", type=str)
    model: dict = field(default_factory=dict, metadata=dict(help="HydraConfig overrides, both archs", type=None))

    @property
    def archs(self) -> list[str]:
        return ["hydra", "dense"] if self.arch == "both" else [self.arch]

    def decode_batch_sizes(self) -> list[int]:
        try:
            sizes = [int(b) for b in self.decode_batches.split(",") if b.strip()]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise ValueError(f"--decode_batches {self.decode_batches!r}: give positive batch sizes, e.g. 1,8,32,128")
        return sizes

    def validate(self) -> None:
        for name in ("batch_size", "seq_len", "steps", "new_tokens", "vocab_size", "chunked_ce_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if "arch" in self.model:  # it would build that model for every row and label one of them wrongly
            raise ValueError("--model.arch cannot be given to bench: --arch hydra|dense|both picks the rows")
        if self.optimizer == "sophia":
            raise ValueError("--optimizer sophia: bench times the trainer's step without Sophia's Hessian estimates "
                             "(an extra forward + backward every few steps); time it with `hydra-lm train` or "
                             "`hydra-lm compare`")
        if self.inference:
            self.decode_batch_sizes()
            if self.new_tokens < 2:  # the decode timing's warm-up takes two steps (an eager one, then the capture)
                raise ValueError(f"new_tokens={self.new_tokens}: --inference times at least 2 decode steps; give "
                                 "--new_tokens 2 or more")


FIELDS = {f.name: f for f in dataclasses.fields(BenchConfig)}


def bench_config(args: argparse.Namespace, model_overrides: dict[str, Any]) -> BenchConfig:
    """The flags typed (None: not typed) over the field defaults; ``run_bench`` validates."""
    typed = {name: getattr(args, name) for name in FIELDS if name != "model" and getattr(args, name) is not None}
    return BenchConfig(**typed, model=dict(model_overrides))

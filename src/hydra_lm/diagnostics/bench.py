"""``hydra-lm bench``: time training steps (and optionally inference) for HYDRA and its dense baseline.

One training step = the trainer's own step (``train.step.TrainStep``: forward + backward, gradient
clipping, AdamW; compiled, CUDA-graphed and with the fused loss as ``hydra-lm train`` would run it
on this device, see ``train.compile_policy``) on random tokens. Warm-up steps are excluded; on CUDA each step
is timed with CUDA events and the median is reported. MFU uses the
FLOPs each routed unit really executed (``executed_flops_per_token``) against a bf16 peak measured
on the device with a large matmul; the datasheet value is shown beside it.

``document_masking`` (on by default, as in the trainer) passes rows of several documents (``doc_ids``)
to the model; each row reports which attention kernels ran (a profiled eager forward) and
which document-mask path the attention took ("flex", "dense-mask" or "none").
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import HydraConfig, preset_config
from ..model.factory import create_model
from .bench_options import BenchConfig
from ..model.accounting import dense_flops_per_token, executed_flops_per_token, kv_cache_bytes_per_token
from ..model.attention_backend import sdpa_kernel_only
from ..model.doc_attention import resolve_doc_mask_backend
from ..model.decode_session import DecodeSession
from ..model.decode_step import decode_compiles
from .step_profile import format_profile, profile_steps
from ..train.checkpoint import write_text_atomic
from ..train.compile_policy import SpeedPlan, apply_speed_plan, resolve_speed_options
from ..train.optim import build_optimizer, check_optimizer_device
from ..train.parallel_compile import start_helpers
from ..train.memory_estimate import FIT_ADVICE, check_fits_host, measure_training_memory
from ..train.options import TrainConfig
from ..train.run import pick_device
from ..train.step import TrainStep

# AdamW's learning rate in a timed step (the value does not change the time).
BENCH_LR = 3e-4
# Dense bf16 tensor-core peaks from the vendor datasheets (TFLOP/s), keyed by a device-name fragment, the first
# fragment in the name deciding: the PCIe and NVL cards run at lower clocks and power than the SXM ones.
DATASHEET_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0, "H200": 989.0,
                         "A100": 312.0}


def datasheet_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)


def measure_peak_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float | None:
    """bf16 matmul throughput of this device (None on CPU, where MFU is not meaningful)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def _timed(fn, device: torch.device) -> float:
    """Seconds one call of ``fn`` takes (CUDA events on GPU, a host clock on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def random_doc_ids(batch: int, seq: int, mean_len: float = 400.0, seed: int = 0,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, T] non-decreasing document ids, like the loader's: a document starts at each position
    with probability 1/mean_len (geometric lengths), the same ids for a given seed."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=g) < 1.0 / mean_len
    starts[:, 0] = False
    return starts.cumsum(1).to(device)


# Profiler names of SDPA's implementations -> the kernel they stand for.
_SDPA_OPS = {"_scaled_dot_product_flash_attention_for_cpu": "flash/cpu",
             "_scaled_dot_product_flash_attention": "flash",
             "_scaled_dot_product_efficient_attention": "efficient",
             "_scaled_dot_product_cudnn_attention": "cudnn",
             "_scaled_dot_product_fused_attention_overrideable": "overrideable",
             "_scaled_dot_product_attention_math": "math"}


def attention_kernels(model, ids: torch.Tensor, doc: torch.Tensor | None, device: torch.device) -> list[str]:
    """SDPA kernels one eager training-mode forward runs (profiled), e.g. ["flash"]; "flex" when
    document-masked attention goes through FlexAttention. Compiled code dispatches SDPA the same
    way for the same shapes and dtypes."""
    from torch.profiler import ProfilerActivity, profile

    found = set()
    if doc is not None and _uses_flex(model, device):
        found.add("flex")  # every layer gets doc ids, so no SDPA call remains to profile
        return sorted(found)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(ids[:1], doc_ids=None if doc is None else doc[:1])
    for event in prof.events():
        name = event.name.split("::")[-1]
        if name in _SDPA_OPS:
            found.add(_SDPA_OPS[name])
    return sorted(found)


def doc_mask_path(model, doc: torch.Tensor | None, device: torch.device) -> str:
    if doc is None:
        return "none"
    return "flex" if _uses_flex(model, device) else "dense-mask"


def _uses_flex(model, device: torch.device) -> bool:
    return resolve_doc_mask_backend(model.config.doc_mask_backend, device, model.config.head_dim) == "flex"


def bench_training(model, cfg: BenchConfig, plan: SpeedPlan, device: torch.device) -> dict[str, Any]:
    """Time the trainer's step (``TrainStep``: forward + backward, clipping, the optimizer with the trainer's
    parameter groups; graphed and compiled as ``plan`` says) on random tokens. With ``cfg.profile``,
    profile 3 more steps afterwards (kernel time by category, Chrome trace there)."""
    batch, seq = cfg.batch_size, cfg.seq_len
    model.to(device).train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    doc = random_doc_ids(batch, seq, device=device) if cfg.document_masking else None
    with sdpa_kernel_only(cfg.sdpa_kernel):
        kernels = attention_kernels(model, ids, doc, device)  # before compiling: eager dispatch
    optimizer = build_optimizer(model, TrainConfig(lr=BENCH_LR, optimizer=cfg.optimizer), device)
    train_step = TrainStep(model, apply_speed_plan(model, model, plan), optimizer, device, plan)
    notes: list[str] = []  # what the parallel compile did before the first step
    train_step.report = notes.append
    inputs = {"input_ids": ids, "targets": torch.roll(ids, -1, 1), **({"doc_ids": doc} if doc is not None else {})}

    def step() -> None:
        with sdpa_kernel_only(cfg.sdpa_kernel):
            train_step.micro(inputs)
            train_step.update()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = _timed(step, device)  # includes compilation
    for _ in range(max(cfg.warmup, 2 if plan.cuda_graph else 0)):  # the graphs are captured during these
        step()
    median = statistics.median(_timed(step, device) for _ in range(cfg.steps))
    flops = executed_flops_per_token(model.config, seq) * batch * seq
    result = {"tokens_per_s": batch * seq / median, "step_ms": median * 1e3, "executed_tflops": flops / median / 1e12,
              "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
              "first_step_s": first, "attention_kernels": kernels, "doc_mask_path": doc_mask_path(model, doc, device),
              "docs_per_row": None if doc is None else float(doc[:, -1].float().mean() + 1),
              "parallel_compile": "; ".join(notes) or None}
    if cfg.profile is not None:
        result["profile"] = profile_steps(step, 3, device, cfg.profile, tag=model.config.arch)
    return result


def _routing_efficiency(model, routed: dict[str, Any], cfg: BenchConfig, plan: SpeedPlan,
                        device: torch.device) -> dict[str, Any]:
    """Time the same model with MoD and MoR switched off, the curriculum's dense mode, and compare:
    efficiency 1.0 means routing saves exactly the time its skipped FLOPs would take."""
    torch._dynamo.reset()
    model.set_curriculum(mod_active=False, mor_active=False)
    try:
        unrouted = bench_training(model, dataclasses.replace(cfg, profile=None), plan, device)
    finally:
        model.set_curriculum(mod_active=True, mor_active=True)
    speedup = routed["tokens_per_s"] / unrouted["tokens_per_s"]
    flop_ratio = dense_flops_per_token(model.config, cfg.seq_len) / executed_flops_per_token(model.config, cfg.seq_len)
    return {"unrouted_tokens_per_s": unrouted["tokens_per_s"], "routing_speedup": speedup,
            "routing_flop_ratio": flop_ratio, "routing_efficiency": speedup / flop_ratio}


@torch.no_grad()
def decode_tokens_per_s(model, batch: int, length: int, device: torch.device, compiled: bool,
                        repeats: int = 3, prompt: torch.Tensor | None = None,
                        device_decisions: bool | None = None) -> tuple[float, float, float, bool]:
    """Steady-state decoding of ``batch`` rows: a prompt of ``length`` tokens is prefilled, then
    ``length`` one-token steps (greedy, CUDA-graphed where ``generate`` does so, units compiled when
    ``compiled``) are timed on their own, median of ``repeats``. Prefill, the first eager
    step (and its compilation) and the graph's capture happen before the clock starts: timing whole
    ``generate`` calls would fold them (and their noise, larger than a short decode at batch 1) into
    the per-token cost. Each timed run starts from a fresh prefill into the same (zeroed) cache: a
    cache's positions are consumed once (``HydraModel.forward_cached``). Returns (tokens/s, routed units
    run per step in the timed runs: the step skips the units no row's token enters, decisions read back
    to the host per step, whether the step took them on the device as CUDA graph IF nodes). ``prompt`` [batch,
    length]: token ids to prefill (default random ones, the same for every run of one batch size: the units a
    step runs follow the prompt, so two revisions or settings then time the same work; a trained model's
    routing wants real text). ``device_decisions``: DecodeStep's (None: its default)."""
    if prompt is None:
        seeded = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, model.config.vocab_size, (batch, length), generator=seeded).to(device)
    session = DecodeSession(model, batch, 2 * length, device, model.decode_capturable(), compiled, device_decisions)
    step = session.step

    def prefill() -> torch.Tensor:
        return session.prefill(prompt).argmax(-1)

    first = prefill()
    for position in (length, length + 1):  # eager warm-up, then the capture
        step(first[:, None], position)

    def decode(token: torch.Tensor) -> float:
        def run() -> None:
            nonlocal token
            for position in range(length, 2 * length):
                token = step(token[:, None], position).argmax(-1)
        return _timed(run, device)

    before, reads = step.unit_calls, step.readbacks
    seconds = statistics.median(decode(prefill()) for _ in range(repeats))
    steps = repeats * length
    return (batch * length / seconds, (step.unit_calls - before) / steps, (step.readbacks - reads) / steps,
            step.device_decisions)


@torch.no_grad()
def prefill_tokens_per_s(model, prompt: torch.Tensor, device: torch.device, compiled: bool,
                         repeats: int = 3) -> float:
    """``generate``'s prefill of the prompt [B, T] into caches of T positions (``DecodeSession.prefill``: with a
    compiled step on CUDA, replayed as a CUDA graph where B x T is at most ``GRAPHED_PREFILL_TOKENS``, else each
    block one compiled graph, launched), median of ``repeats`` after two warm-up calls (the first compiles, the second
    captures).
    (A plain forward is not it: the prefill also writes every unit's caches and routing state.)"""
    session = DecodeSession(model, prompt.shape[0], prompt.shape[1], device, model.decode_capturable(), compiled)
    for _ in range(2):
        session.prefill(prompt)
    return prompt.numel() / statistics.median(_timed(lambda: session.prefill(prompt), device) for _ in range(repeats))


@torch.no_grad()
def bench_inference(model, cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    model.to(device).eval()
    result: dict[str, Any] = {"decode_len": cfg.new_tokens, "prefill_len": cfg.seq_len}
    ids = torch.randint(0, model.config.vocab_size, (8, cfg.seq_len), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        compiled = decode_compiles(device, cfg.decode_compile)
        result["prefill_tokens_per_s"] = prefill_tokens_per_s(model, ids, device, compiled)
        for batch in cfg.decode_batch_sizes():
            rate, units, reads, on_device = decode_tokens_per_s(model, batch, cfg.new_tokens, device, compiled,
                                                                device_decisions=cfg.decode_device_decisions)
            result[f"decode_tokens_per_s_batch{batch}"] = rate
            result[f"decode_units_per_step_batch{batch}"] = units
            result[f"decode_readbacks_per_step_batch{batch}"] = reads
        result["routed_units"] = sum(block.recursions for block in model.blocks)
        result["decode_cuda_graph"] = model.decode_capturable()
        result["decode_device_decisions"] = on_device  # as the last batch's step ran (after any fallback)
        result["decode_compiled"] = compiled
        # In the dtype the sessions' caches took (HydraModel.init_cache): autocast's bf16 on CUDA, the weights' on CPU.
        cached = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else \
            model.embed.weight.dtype
    result["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(model.config, 2 * cfg.new_tokens,
                                                                  bytes_per_value=cached.itemsize)
    return result


def run_bench(cfg: BenchConfig, on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Time each arch in turn; ``on_row(report)`` is called after every finished row, so a caller can
    show and save partial results of a long (compiling) run."""
    cfg.validate()
    dev = pick_device(cfg.device)
    check_optimizer_device(cfg.optimizer, dev)
    plan = resolve_speed_options(cfg, dev, distributed=False, moe=bool(cfg.model.get("moe")))
    if plan.parallel_compile and cfg.archs[0] == "hydra":
        start_helpers()  # their imports overlap the set-up below: the peak measurement, model, optimizer
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    peak = measure_peak_tflops(dev)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "measured_bf16_peak_tflops": peak, "datasheet_bf16_peak_tflops": datasheet_peak(dev),
        # Kernels are model config (--model.attention_backend, --model.doc_mask_backend), shared by both archs.
        "attention_backend": cfg.model.get("attention_backend", HydraConfig.attention_backend),
        "doc_mask_backend": cfg.model.get("doc_mask_backend", HydraConfig.doc_mask_backend),
        "batch": cfg.batch_size, "seq_len": cfg.seq_len, "optimizer": cfg.optimizer, "compile": plan.compile,
        "cuda_graph": plan.cuda_graph,
        "document_masking": cfg.document_masking, "ce_impl": plan.ce_impl, "chunked_ce_size": plan.ce_chunk_size,
        "sdpa_kernel": cfg.sdpa_kernel, "model_overrides": dict(cfg.model),
        "speed": plan.describe(), "rows": [],
    }
    max_len = max(cfg.seq_len, 2 * cfg.new_tokens if cfg.inference else 0, 64)
    for arch in cfg.archs:
        torch.manual_seed(0)
        model_cfg = preset_config(cfg.model_size, **{"arch": arch, "vocab_size": cfg.vocab_size,
                                                     "max_seq_len": max_len, **cfg.model})
        if dev.type == "cpu":  # before the weights exist: a model too large for the host is refused too
            check_fits_host(measure_training_memory(model_cfg, cfg.batch_size, cfg.seq_len, cfg.optimizer)["peak_mb"],
                            f"bench of {cfg.model_size} ({arch}) on batches of {cfg.batch_size} x {cfg.seq_len}",
                            FIT_ADVICE["bench"])
        model = create_model(model_cfg)
        row: dict[str, Any] = {"arch": arch, "params_m": model.num_parameters() / 1e6}
        row.update(bench_training(model, cfg, plan, dev))
        row["ce_impl"] = model.ce_impl
        row["mfu"] = row["executed_tflops"] / peak if peak else None
        if cfg.routing_efficiency and arch == "hydra":
            row.update(_routing_efficiency(model, row, cfg, plan, dev))
        if cfg.inference:
            row.update(bench_inference(model, cfg, dev))
        report["rows"].append(row)
        if on_row is not None:
            on_row(report)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return report


def format_report(report: dict[str, Any]) -> str:
    def num(v):
        return "-" if v is None else f"{v:.0f}"

    r0 = report
    header = [f"device {r0['device']}", f"torch {r0['torch']}",
              f"bf16 peak measured {num(r0['measured_bf16_peak_tflops'])} / datasheet "
              f"{num(r0['datasheet_bf16_peak_tflops'])} TFLOP/s",
              f"attention {r0['attention_backend']} (SDPA kernel: {r0['sdpa_kernel']})",
              f"batch {r0['batch']} x {r0['seq_len']}", f"optimizer {r0.get('optimizer', 'adamw')}",
              ", ".join(r0["speed"]),
              f"document masking {'on' if r0['document_masking'] else 'off'} (backend {r0['doc_mask_backend']})"]
    if r0.get("model_overrides"):
        header.append("overrides " + ",".join(f"{k}={v}" for k, v in r0["model_overrides"].items()))
    lines = [" | ".join(header),
             f"{'arch':<7}{'params':>9}{'tok/s':>12}{'ms/step':>9}{'TFLOP/s':>9}{'MFU':>7}{'peak GB':>9}"
             f"{'1st step s':>11}  {'doc mask':<11}attention kernels"]
    for r in report["rows"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        lines.append(f"{r['arch']:<7}{r['params_m']:>8.1f}M{r['tokens_per_s']:>12,.0f}{r['step_ms']:>9.1f}"
                     f"{r['executed_tflops']:>9.2f}{mfu:>7}{mem:>9}{r['first_step_s']:>11.1f}"
                     f"  {r['doc_mask_path']:<11}{','.join(r['attention_kernels']) or '-'}")
        if "prefill_tokens_per_s" in r:
            step = [name for name, on in (("compiled", r.get("decode_compiled")),
                                          ("CUDA graph", r["decode_cuda_graph"]),
                                          ("decisions on the device", r.get("decode_device_decisions"))) if on]
            graph = f" ({', '.join(step)})" if step else ""
            decode = ", ".join(f"batch {k.removeprefix('decode_tokens_per_s_batch')} {v:,.0f}" for k, v in r.items()
                               if k.startswith("decode_tokens_per_s_batch"))
            units = "/".join(f"{v:.1f}" for k, v in r.items() if k.startswith("decode_units_per_step_batch"))
            reads = "/".join(f"{v:.1f}" for k, v in r.items() if k.startswith("decode_readbacks_per_step_batch"))
            lines.append(f"{'':<7}inference: prefill {r['prefill_tokens_per_s']:,.0f} tok/s (8 x {r['prefill_len']}) | "
                         f"decode{graph} {r['decode_len']} after {r['decode_len']} prompt tokens, tok/s: {decode} | "
                         f"units run per step {units} of {r['routed_units']}, decisions read back {reads} | KV cache "
                         f"{r['kv_cache_bytes_per_token']['allocated'] / 1024:.1f} KiB/token")
        if "routing_efficiency" in r:
            lines.append(f"{'':<7}routing: {r['routing_speedup']:.2f}x the tokens/s of the same model unrouted "
                         f"({r['unrouted_tokens_per_s']:,.0f}); FLOP ratio {r['routing_flop_ratio']:.2f}x -> routing "
                         f"efficiency {r['routing_efficiency']:.0%}")
    lines += [format_profile(r["arch"], r["profile"]) for r in report["rows"] if r.get("profile")]
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    # Rewritten after every row: atomically, so a run killed mid-write keeps the rows it had finished.
    write_text_atomic(Path(path), json.dumps(report, indent=1))

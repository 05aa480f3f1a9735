"""``hydra-lm bench``: time training steps (and optionally inference) for HYDRA and its dense baseline.

One training step = forward + backward + optimizer step on random tokens. Warm-up steps are
excluded; on CUDA each step is timed with CUDA events and the median is reported. MFU uses the
FLOPs each routed unit really executed (``executed_flops_per_token``) against a bf16 peak measured
on the device with a large matmul; the datasheet value is shown beside it.

``document_masking`` times the trainer's default path (rows of several documents, ``doc_ids``
passed to the model); each row reports which attention kernels ran (a profiled eager forward) and
which document-mask path the attention took ("flex", "dense-mask" or "none").
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import torch

from .model.factory import create_model
from .model.accounting import dense_flops_per_token, executed_flops_per_token, kv_cache_bytes_per_token
from .model.attention_backend import get_attention_backend, sdpa_kernel_only
from .model.doc_attention import get_doc_mask_backend, resolve_doc_mask_backend
from .step_profile import format_profile, profile_steps
from .model.cuda_graphs import GraphedStep

# model: one graph; regions: one graph with layers as shared nested regions (HydraModel.compile_regions);
# blocks: HydraModel.compile_blocks; units: HydraModel.compile_units (routing eager, dynamic token counts).
COMPILE_SCOPES = ("model", "regions", "blocks", "units")
# Dense bf16 tensor-core peaks from the vendor datasheets (TFLOP/s), keyed by a device-name fragment.
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


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
    if doc is not None and resolve_doc_mask_backend(device) == "flex":
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


def doc_mask_path(doc: torch.Tensor | None, device: torch.device) -> str:
    if doc is None:
        return "none"
    return "flex" if resolve_doc_mask_backend(device) == "flex" else "dense-mask"


def bench_training(model, batch: int, seq: int, steps: int, warmup: int, compile_model: bool,
                   device: torch.device, document_masking: bool = False,
                   compile_scope: str = "model", compile_mode: str = "default",
                   sdpa_kernel: str = "auto", cuda_graph: bool = False,
                   profile_dir: str | None = None) -> dict[str, Any]:
    """``compile_mode`` "reduce-overhead" captures the compiled forward and backward as CUDA graphs;
    ``cuda_graph`` captures the whole step (forward, backward, optimizer; compiled or not) as one
    CUDA graph (``GraphedStep``). ``profile_dir``: afterwards profile 3 more steps (kernel time by
    category, Chrome trace there)."""
    if cuda_graph and device.type != "cuda":
        raise ValueError("cuda_graph needs a CUDA device; drop --cuda_graph on the CPU")
    if cuda_graph and compile_model and compile_mode == "reduce-overhead":
        raise ValueError("cuda_graph already graphs the whole step: use it with --compile_mode default, "
                         "not reduce-overhead (whose graphs cannot nest inside another capture)")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda", capturable=cuda_graph)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    doc = random_doc_ids(batch, seq, device=device) if document_masking else None
    with sdpa_kernel_only(sdpa_kernel):
        kernels = attention_kernels(model, ids, doc, device)  # before compiling: eager dispatch
    if not compile_model:
        fwd = model
    elif compile_scope == "regions":
        fwd = model.compile_regions(mode=compile_mode)
    elif compile_scope == "blocks":
        fwd = model.compile_blocks(mode=compile_mode)
    elif compile_scope == "units":
        fwd = model.compile_units(mode=compile_mode)
    else:
        fwd = torch.compile(model, fullgraph=True, mode=compile_mode)
    targets = torch.roll(ids, -1, 1)
    use_bf16 = device.type == "cuda"
    graphs = compile_model and compile_mode == "reduce-overhead"

    def eager_step():
        if graphs:  # a new iteration: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        # Autocast's cast cache would hold tensors across a capture boundary: off under cuda_graph.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16, cache_enabled=not cuda_graph), \
                sdpa_kernel_only(sdpa_kernel):
            loss = fwd(ids, targets=targets, doc_ids=doc)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step = GraphedStep(eager_step, warmup=2) if cuda_graph else eager_step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = _timed(step, device)  # includes compilation
    for _ in range(max(warmup, 2 if cuda_graph else 0)):  # the graph is captured during these
        step()
    median = statistics.median(_timed(step, device) for _ in range(steps))
    flops = executed_flops_per_token(model.config, seq) * batch * seq
    result = {"tokens_per_s": batch * seq / median, "step_ms": median * 1e3, "executed_tflops": flops / median / 1e12,
              "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
              "first_step_s": first, "attention_kernels": kernels, "doc_mask_path": doc_mask_path(doc, device),
              "docs_per_row": None if doc is None else float(doc[:, -1].float().mean() + 1)}
    if profile_dir is not None:
        result["profile"] = profile_steps(step, 3, device, profile_dir, tag=model.config.arch)
    return result


def _routing_efficiency(model, routed: dict[str, Any], seq: int, timing_args: tuple) -> dict[str, Any]:
    """Time the same model (``bench_training(model, *timing_args)``) with MoD and MoR switched off,
    the curriculum's dense mode, and compare: efficiency 1.0 means routing saves exactly the time
    its skipped FLOPs would take."""
    torch._dynamo.reset()
    model.set_curriculum(mod_active=False, mor_active=False)
    try:
        unrouted = bench_training(model, *timing_args)
    finally:
        model.set_curriculum(mod_active=True, mor_active=True)
    speedup = routed["tokens_per_s"] / unrouted["tokens_per_s"]
    flop_ratio = dense_flops_per_token(model.config, seq) / executed_flops_per_token(model.config, seq)
    return {"unrouted_tokens_per_s": unrouted["tokens_per_s"], "routing_speedup": speedup,
            "routing_flop_ratio": flop_ratio, "routing_efficiency": speedup / flop_ratio}


@torch.no_grad()
def bench_inference(model, seq: int, new_tokens: int, device: torch.device) -> dict[str, Any]:
    model.to(device).eval()
    vocab = model.config.vocab_size
    result: dict[str, Any] = {}
    ids = torch.randint(0, vocab, (8, seq), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        model(ids)  # warm-up
        result["prefill_tokens_per_s"] = ids.numel() / _timed(lambda: model(ids), device)
        for batch in (1, 32):
            prompt = torch.randint(0, vocab, (batch, 16), device=device)
            # Steady-state decoding: the time of `new_tokens` steps minus that of half as many (the
            # prompt, the first step and a CUDA graph's capture cancel out), median of 3 each.
            half = max(1, new_tokens // 2)
            full_s, half_s = (statistics.median(_timed(lambda p=prompt, k=n: model.generate(p, k), device)
                                                for _ in range(3)) for n in (new_tokens, half))
            result[f"decode_tokens_per_s_batch{batch}"] = batch * (new_tokens - half) / max(full_s - half_s, 1e-9)
            result[f"generate_s_batch{batch}"] = full_s
        result["decode_cuda_graph"] = model.decode_capturable()
    result["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(model.config, seq)
    return result


def run_bench(model_size: str, archs: list[str], batch: int, seq: int, steps: int, warmup: int,
              compile_model: bool, inference: bool, device: str = "auto", vocab_size: int = 50257,
              new_tokens: int = 32, document_masking: bool = False, compile_scope: str = "model",
              conv_impl: str = "taps", on_row: Callable[[dict[str, Any]], None] | None = None,
              compile_mode: str = "default", ce_impl: str = "naive", sdpa_kernel: str = "auto",
              profile_dir: str | None = None, model_overrides: dict[str, Any] | None = None,
              routing_efficiency: bool = False, cuda_graph: bool = False, ce_chunk_size: int = 4096) -> dict[str, Any]:
    """Time each arch in turn; ``on_row(report)`` is called after every finished row, so a caller can
    show and save partial results of a long (compiling) run. ``model_overrides``: config fields
    replacing the preset's (both archs). ``routing_efficiency``: also time the HYDRA model with
    routing off (every token runs every unit) and report achieved speedup / FLOP-ratio speedup.
    ``cuda_graph``: capture each whole training step as one CUDA graph (``GraphedStep``).
    ``ce_chunk_size``: rows per chunk of the fused loss (``ce_impl`` other than "naive")."""
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope={compile_scope!r}: choose one of {list(COMPILE_SCOPES)}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    peak = measure_peak_tflops(dev)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "measured_bf16_peak_tflops": peak, "datasheet_bf16_peak_tflops": datasheet_peak(dev),
        "attention_backend": get_attention_backend(), "doc_mask_backend": get_doc_mask_backend(),
        "batch": batch, "seq_len": seq, "compiled": compile_model,
        "compile_scope": compile_scope if compile_model else None,
        "compile_mode": compile_mode if compile_model else None, "cuda_graph": cuda_graph,
        "document_masking": document_masking,
        "ce_impl": ce_impl, "ce_chunk_size": ce_chunk_size, "sdpa_kernel": sdpa_kernel,
        "conv_impl": conv_impl, "model_overrides": dict(model_overrides or {}), "rows": [],
    }
    for arch in archs:
        torch.manual_seed(0)
        model = create_model(model_size, **{"arch": arch, "vocab_size": vocab_size, "max_seq_len": max(seq, 64),
                                            **(model_overrides or {})})
        model.set_conv_impl(conv_impl)
        model.ce_impl, model.ce_chunk_size = ce_impl, ce_chunk_size
        row: dict[str, Any] = {"arch": arch, "params_m": model.num_parameters() / 1e6, "ce_impl": model.ce_impl}
        timing = (batch, seq, steps, warmup, compile_model, dev, document_masking, compile_scope, compile_mode,
                  sdpa_kernel, cuda_graph)
        row.update(bench_training(model, *timing, profile_dir))
        row["mfu"] = row["executed_tflops"] / peak if peak else None
        if routing_efficiency and arch == "hydra":
            row.update(_routing_efficiency(model, row, seq, timing))
        if inference:
            row.update(bench_inference(model, seq, new_tokens, dev))
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
    compiled = f"compiled ({r0['compile_scope']}, {r0['compile_mode']})" if r0["compiled"] else "eager"
    if r0.get("cuda_graph"):
        compiled += ", whole step as one CUDA graph"
    header = [f"device {r0['device']}", f"torch {r0['torch']}",
              f"bf16 peak measured {num(r0['measured_bf16_peak_tflops'])} / datasheet "
              f"{num(r0['datasheet_bf16_peak_tflops'])} TFLOP/s",
              f"attention {r0['attention_backend']} (SDPA kernel: {r0['sdpa_kernel']})",
              f"batch {r0['batch']} x {r0['seq_len']}", compiled,
              f"document masking {'on' if r0['document_masking'] else 'off'} (backend {r0['doc_mask_backend']})",
              f"convs {r0['conv_impl']}",
              f"loss {r0['ce_impl']}" + (f" (chunks of {r0['ce_chunk_size']})" if r0["ce_impl"] != "naive" else "")]
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
            graph = " (CUDA graph)" if r["decode_cuda_graph"] else ""
            lines.append(f"{'':<7}inference: prefill {r['prefill_tokens_per_s']:,.0f} tok/s | decode{graph} batch 1 "
                         f"{r['decode_tokens_per_s_batch1']:,.0f} tok/s, batch 32 "
                         f"{r['decode_tokens_per_s_batch32']:,.0f} tok/s | KV cache "
                         f"{r['kv_cache_bytes_per_token']['allocated'] / 1024:.1f} KiB/token")
        if "routing_efficiency" in r:
            lines.append(f"{'':<7}routing: {r['routing_speedup']:.2f}x the tokens/s of the same model unrouted "
                         f"({r['unrouted_tokens_per_s']:,.0f}); FLOP ratio {r['routing_flop_ratio']:.2f}x -> routing "
                         f"efficiency {r['routing_efficiency']:.0%}")
    lines += [format_profile(r["arch"], r["profile"]) for r in report["rows"] if r.get("profile")]
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)

"""``hydra-lm bench``: time training steps (and optionally inference) for HYDRA and its dense baseline.

One training step = forward + backward + optimizer step on random tokens. Warm-up steps are
excluded; on CUDA each step is timed with CUDA events and the median is reported. MFU uses the
FLOPs each routed unit really executed (``executed_flops_per_token``) against a bf16 peak measured
on the device with a large matmul; the datasheet value is shown beside it.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from . import create_model
from .model.accounting import executed_flops_per_token, kv_cache_bytes_per_token
from .model.attention_backend import get_attention_backend

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


def bench_training(model, batch: int, seq: int, steps: int, warmup: int, compile_model: bool,
                   device: torch.device) -> dict[str, Any]:
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    fwd = torch.compile(model, fullgraph=True) if compile_model else model
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    targets = torch.roll(ids, -1, 1)
    use_bf16 = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = fwd(ids, targets=targets)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = _timed(step, device)  # includes compilation
    for _ in range(warmup):
        step()
    median = statistics.median(_timed(step, device) for _ in range(steps))
    flops = executed_flops_per_token(model.config, seq) * batch * seq
    return {"tokens_per_s": batch * seq / median, "step_ms": median * 1e3, "executed_tflops": flops / median / 1e12,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
            "first_step_s": first}


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
            seconds = _timed(lambda: model.generate(prompt, new_tokens), device)
            result[f"decode_tokens_per_s_batch{batch}"] = batch * new_tokens / seconds
    result["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(model.config, seq)
    return result


def run_bench(model_size: str, archs: list[str], batch: int, seq: int, steps: int, warmup: int,
              compile_model: bool, inference: bool, device: str = "auto", vocab_size: int = 50257,
              new_tokens: int = 32) -> dict[str, Any]:
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    peak = measure_peak_tflops(dev)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "measured_bf16_peak_tflops": peak, "datasheet_bf16_peak_tflops": datasheet_peak(dev),
        "attention_backend": get_attention_backend(), "batch": batch, "seq_len": seq, "compiled": compile_model,
        "rows": [],
    }
    for arch in archs:
        torch.manual_seed(0)
        model = create_model(model_size, arch=arch, vocab_size=vocab_size, max_seq_len=max(seq, 64))
        row: dict[str, Any] = {"arch": arch, "params_m": model.num_parameters() / 1e6, "ce_impl": model.ce_impl}
        row.update(bench_training(model, batch, seq, steps, warmup, compile_model, dev))
        row["mfu"] = row["executed_tflops"] / peak if peak else None
        if inference:
            row.update(bench_inference(model, seq, new_tokens, dev))
        report["rows"].append(row)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return report


def format_report(report: dict[str, Any]) -> str:
    def num(v):
        return "-" if v is None else f"{v:.0f}"

    lines = [f"device {report['device']} | torch {report['torch']} | bf16 peak measured "
             f"{num(report['measured_bf16_peak_tflops'])} / datasheet {num(report['datasheet_bf16_peak_tflops'])} TFLOP/s"
             f" | attention {report['attention_backend']} (SDPA picks its kernel) | batch {report['batch']} x "
             f"{report['seq_len']} | {'compiled' if report['compiled'] else 'eager'}",
             f"{'arch':<7}{'params':>9}{'tok/s':>12}{'ms/step':>9}{'TFLOP/s':>9}{'MFU':>7}{'peak GB':>9}{'1st step s':>11}"]
    for r in report["rows"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        lines.append(f"{r['arch']:<7}{r['params_m']:>8.1f}M{r['tokens_per_s']:>12,.0f}{r['step_ms']:>9.1f}"
                     f"{r['executed_tflops']:>9.2f}{mfu:>7}{mem:>9}{r['first_step_s']:>11.1f}")
        if "prefill_tokens_per_s" in r:
            lines.append(f"{'':<7}inference: prefill {r['prefill_tokens_per_s']:,.0f} tok/s | decode batch 1 "
                         f"{r['decode_tokens_per_s_batch1']:,.0f} tok/s, batch 32 {r['decode_tokens_per_s_batch32']:,.0f}"
                         f" tok/s | KV cache {r['kv_cache_bytes_per_token']['allocated'] / 1024:.1f} KiB/token")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)

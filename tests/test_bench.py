"""The bench command runs end to end on CPU and reports what it promises."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hydra_lm
import hydra_lm.diagnostics.bench
import hydra_lm.cli
from hydra_lm.diagnostics.bench import run_bench
from hydra_lm.diagnostics.bench_options import BenchConfig


def tiny(**changes) -> BenchConfig:
    """A debug-preset bench on the CPU that takes seconds."""
    return BenchConfig(**{"model_size": "debug", "arch": "hydra", "batch_size": 1, "seq_len": 32, "steps": 1,
                          "warmup": 0, "vocab_size": 512, "device": "cpu", **changes})


@pytest.mark.slow
def test_bench_reports_training_and_inference_for_both_archs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = hydra_lm.cli.main(["bench", "--model_size", "debug", "--vocab_size", "512", "--batch_size", "2",
                              "--seq_len", "32", "--steps", "2", "--warmup", "1", "--no-compile", "--inference",
                              "--new_tokens", "3", "--decode_batches", "1,32", "--device", "cpu", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "hydra" in text and "dense" in text and "decode 3 after 3 prompt tokens, tok/s: batch 1 " in text
    assert "inference: prefill " in text and " tok/s (8 x 32) | decode" in text
    report = json.loads(out.read_text())
    assert [r["arch"] for r in report["rows"]] == ["hydra", "dense"]
    for row in report["rows"]:
        assert row["tokens_per_s"] > 0 and row["executed_tflops"] > 0 and row["mfu"] is None  # no MFU on CPU
        assert row["decode_tokens_per_s_batch32"] > 0 and row["kv_cache_bytes_per_token"]["allocated"] > 0
        assert row["decode_cuda_graph"] is False and row["decode_tokens_per_s_batch1"] > 0 and row["decode_len"] == 3
        assert row["decode_compiled"] is False  # CPU default: the eager step
        assert row["prefill_tokens_per_s"] > 0 and row["prefill_len"] == 32
        assert "decode_tokens_per_s_batch8" not in row
        # the dense model runs every layer; HYDRA's step skips the routed units no token enters
        units = [row[f"decode_units_per_step_batch{b}"] for b in (1, 32)]
        assert 0 < units[0] <= units[1] <= row["routed_units"]
        assert (units[1] == row["routed_units"]) == (row["arch"] == "dense")
        # K and V as the caches hold them: fp32 on a CPU (no autocast), one slot a unit and position
        caches = hydra_lm.create_model("debug", vocab_size=512, arch=row["arch"]).init_cache(1, 6)
        flat = [c for block in caches for depth in block for c in depth]
        assert row["kv_cache_bytes_per_token"]["allocated"] == sum(c.k.nbytes + c.v.nbytes for c in flat) / 6
    assert report["rows"][0]["ce_impl"] == "naive" and report["measured_bf16_peak_tflops"] is None
    with pytest.raises(ValueError, match="--new_tokens 2 or more"):  # the timing's two warm-up steps
        BenchConfig(inference=True, new_tokens=1).validate()


def test_bench_document_masking_reports_the_mask_path_and_kernels(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = hydra_lm.cli.main(["bench", "--model_size", "debug", "--arch", "hydra", "--vocab_size", "512",
                              "--batch_size", "2", "--seq_len", "64", "--steps", "1", "--warmup", "0", "--no-compile",
                              "--device", "cpu", "--json", str(out),
                              "--model.doc_mask_backend", "sdpa"])
    assert code == 0
    report = json.loads(out.read_text())
    row = report["rows"][0]
    # document masking on by default: the trainer's default path
    assert report["document_masking"] and report["compile"] is None
    assert (report["doc_mask_backend"], report["attention_backend"]) == ("sdpa", "auto")  # model config fields
    assert row["doc_mask_path"] == "dense-mask"  # CPU: the dense SDPA mask
    assert row["attention_kernels"] and all(k in ("math", "flash/cpu") for k in row["attention_kernels"])
    assert row["docs_per_row"] >= 1
    assert "dense-mask" in capsys.readouterr().out


def test_forced_sdpa_kernel_and_fused_loss_are_what_runs(tmp_path):
    out = tmp_path / "bench.json"
    code = hydra_lm.cli.main(["bench", "--model_size", "debug", "--arch", "hydra", "--vocab_size", "512",
                              "--batch_size", "2", "--seq_len", "64", "--steps", "1", "--warmup", "0", "--no-compile",
                              "--sdpa_kernel", "math", "--chunked_ce", "--device", "cpu", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert report["sdpa_kernel"] == "math" and row["attention_kernels"] == ["math"]  # CPU's default is flash/cpu
    # No CUDA graph: "auto" (Liger where installed on CUDA, the chunked path here)
    assert row["ce_impl"] == "auto" and row["tokens_per_s"] > 0 and report["chunked_ce_size"] == 4096


def test_bench_passes_the_loss_chunk_size_and_refuses_cuda_graphs_on_cpu(monkeypatch):
    from hydra_lm.model import loss

    seen = []
    real = loss._chunked_pass
    monkeypatch.setattr(loss, "_chunked_pass", lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    report = run_bench(tiny(batch_size=2, chunked_ce=True, chunked_ce_size=16))
    assert report["chunked_ce_size"] == 16 and seen and set(seen) == {16}
    with pytest.raises(ValueError, match="--cuda_graph needs a CUDA device"):
        run_bench(tiny(cuda_graph=True))


def test_bench_on_the_cpu_defaults_to_eager_and_times_the_trainers_step(monkeypatch):
    """First step + warm-up + timed steps, each one micro-batch and one clipped update of TrainStep."""
    from hydra_lm.train.step import TrainStep

    calls = []
    micro, update = TrainStep.micro_step, TrainStep.update_step
    monkeypatch.setattr(TrainStep, "micro_step", lambda self, **kw: calls.append("micro") or micro(self, **kw))
    monkeypatch.setattr(TrainStep, "update_step", lambda self: calls.append("update") or update(self))
    clips = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: clips.append(max_norm) or
                        clip(params, max_norm))
    report = run_bench(tiny(steps=2, warmup=1))
    assert (report["compile"], report["cuda_graph"], report["ce_impl"]) == (None, False, "naive")
    assert report["speed"] == ["eager"]
    assert calls == ["micro", "update"] * 4 and clips == [1.0] * 4


def test_bench_times_the_step_with_the_chosen_optimizer(monkeypatch):
    from hydra_lm.train.muon import Muon

    steps = []
    step = Muon.step
    monkeypatch.setattr(Muon, "step", lambda self, closure=None: steps.append(1) or step(self))
    report = run_bench(tiny(optimizer="muon", steps=2, warmup=1))
    assert report["optimizer"] == "muon" and report["rows"][0]["tokens_per_s"] > 0
    assert len(steps) == 4  # first step, warm-up, two timed
    with pytest.raises(ValueError, match="without Sophia's Hessian estimates"):
        run_bench(tiny(optimizer="sophia"))
    with pytest.raises(ValueError, match="runs on CUDA only"):
        run_bench(tiny(optimizer="adam8bit"))


def test_random_doc_ids_look_like_the_loaders():
    from hydra_lm.diagnostics.bench import random_doc_ids

    doc = random_doc_ids(8, 4096, mean_len=400, seed=0)
    assert torch.equal(doc, random_doc_ids(8, 4096, mean_len=400, seed=0))
    assert (doc[:, 0] == 0).all() and (doc.diff(dim=1) >= 0).all() and (doc.diff(dim=1) <= 1).all()
    mean_length = doc.numel() / (doc[:, -1] + 1).sum().item()
    assert 250 < mean_length < 600


def test_bench_without_documents_reports_none_and_refuses_what_cannot_run():
    report = run_bench(tiny(arch="dense", document_masking=False))
    assert report["rows"][0]["doc_mask_path"] == "none" and report["rows"][0]["docs_per_row"] is None
    with pytest.raises(ValueError, match="--decode_batches"):
        run_bench(tiny(inference=True, decode_batches="1,x"))
    with pytest.raises(ValueError, match="--model.arch cannot be given to bench"):
        run_bench(tiny(model={"arch": "dense"}))


@pytest.mark.slow
def test_bench_applies_model_overrides_and_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = hydra_lm.cli.main(["bench", "--model_size", "debug", "--arch", "hydra", "--vocab_size", "512",
                              "--batch_size", "1", "--seq_len", "32", "--steps", "1", "--warmup", "0", "--no-compile",
                              "--model.mod_capacity", "0.5", "--model.mod_every", "1", "--device", "cpu",
                              "--profile", str(tmp_path / "prof"), "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["model_overrides"] == {"mod_capacity": 0.5, "mod_every": 1}
    row = report["rows"][0]
    # Half of every row enters the second block (the first runs every token): more executed FLOPs than the
    # preset's 0.125 on every 2nd block.
    preset = run_bench(tiny())["rows"][0]
    assert row["executed_tflops"] * row["step_ms"] > preset["executed_tflops"] * preset["step_ms"]
    assert (tmp_path / "prof" / "trace_hydra.json").stat().st_size > 0 and row["profile"]["trace"]
    assert "overrides mod_capacity=0.5,mod_every=1" in capsys.readouterr().out


def test_kernel_categories():
    from hydra_lm.diagnostics.step_profile import kernel_category

    assert kernel_category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_category("flash_fwd_kernel<Flash_fwd_kernel_traits<32, 128, 128, 4>>") == "attention"
    assert kernel_category("triton_poi_fused_add_mul_0") == "fused pointwise"
    assert kernel_category("triton_red_fused__to_copy_mul_sum_3") == "reduction"
    assert kernel_category("void at::native::_scatter_gather_elementwise_kernel<128, 4>") == "gather/scatter"
    assert kernel_category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == "optimizer"
    assert kernel_category("triton_tem_fused_mm_4") == "gemm"
    assert kernel_category("some_unknown_kernel") == "other"


@pytest.mark.slow
def test_routing_efficiency_compares_with_the_same_model_unrouted():
    from hydra_lm.diagnostics.bench import format_report
    from hydra_lm.model.accounting import dense_flops_per_token, executed_flops_per_token

    report = run_bench(tiny(arch="both", routing_efficiency=True))
    hydra, dense = report["rows"]
    cfg = hydra_lm.create_model("debug", vocab_size=512, max_seq_len=64).config
    ratio = dense_flops_per_token(cfg, 32) / executed_flops_per_token(cfg, 32)
    assert hydra["routing_flop_ratio"] == pytest.approx(ratio)
    assert hydra["routing_flop_ratio"] > 1.2  # the debug preset skips a real share of the work
    assert hydra["unrouted_tokens_per_s"] > 0
    assert hydra["routing_efficiency"] == pytest.approx(hydra["routing_speedup"] / hydra["routing_flop_ratio"])
    assert "routing_efficiency" not in dense  # nothing to compare for the dense baseline
    assert "routing efficiency" in format_report(report)


def test_kernel_summary_per_step_category_and_top():
    from hydra_lm.diagnostics.step_profile import format_profile, summarize_kernels

    gemm, pointwise = "nvjet_sm90_tst_192x192", "triton_poi_fused_add_0"
    launches = [(gemm, 300.0), (pointwise, 50.0)] * 2 + [(gemm, 200.0)]  # (name, us) over 2 steps
    summary = summarize_kernels(launches, steps=2, top=1)
    assert summary["device_ms_per_step"] == pytest.approx((800 + 100) / 1e3 / 2)
    assert summary["kernels_per_step"] == 2.5
    assert summary["categories_ms"] == pytest.approx({"gemm": 0.4, "fused pointwise": 0.05})
    assert list(summary["categories_ms"]) == ["gemm", "fused pointwise"]  # largest first
    assert summary["top_kernels"] == [{"name": gemm, "ms": pytest.approx(0.4), "calls": 1.5, "category": "gemm"}]
    assert "gemm" in format_profile("hydra", {"trace": None, **summary})


def test_device_idle_time_counts_the_gaps_between_kernels_and_those_after_memsets():
    from hydra_lm.diagnostics.step_profile import device_idle, format_profile, summarize_kernels

    # (start us, end us, name) over 2 steps: a 4-ms gap after a memset, a 1-ms gap after a kernel, an event on a
    # second stream inside another (no gap), unsorted as a profiler may list them
    events = [(20e3, 30e3, "nvjet_gemm"), (0.0, 10e3, "triton_poi_fused_add_0"), (10e3, 11e3, "Memset (Device)"),
              (15e3, 19e3, "triton_red_fused_sum_1"), (21e3, 25e3, "triton_poi_fused_mul_2"),
              (30e3, 31e3, "Memset (Device)")]
    idle = device_idle(events, steps=2)
    assert idle == {"idle_ms_per_step": pytest.approx(2.5), "idle_after_memsets_ms_per_step": pytest.approx(2.0),
                    "memsets_per_step": 1.0}
    summary = summarize_kernels([(name, stop - start) for start, stop, name in events], steps=2)
    assert "idle between kernels 2.50 ms/step, 2.00 ms of it after the 1 memsets a step" in \
        format_profile("hydra", {"trace": None, **summary, **idle})


def test_every_kernel_goes_to_a_table_small_enough_to_bring_back(tmp_path):
    import csv

    from hydra_lm.diagnostics.step_profile import summarize_kernels, write_kernel_table

    long_name = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>> " + "x" * 200
    launches = [("nvjet_sm90_tst_192x192", 300.0), ("triton_poi_fused_add_0", 50.0), (long_name, 8.0)] * 2
    write_kernel_table(str(tmp_path / "k.csv"), summarize_kernels(launches, steps=2, top=None))
    rows = list(csv.DictReader(open(tmp_path / "k.csv", encoding="utf-8")))
    assert [r["kernel"] for r in rows] == ["nvjet_sm90_tst_192x192", "triton_poi_fused_add_0", long_name]
    assert [float(r["ms_per_step"]) for r in rows] == pytest.approx([0.3, 0.05, 0.008])
    assert rows[2]["launches_per_step"] == "1" and rows[2]["category"] == "other"
    # benchmarks/kernel_table_diff.py matches inductor's kernels across two runs' tables whatever their suffixes.
    write_kernel_table(str(tmp_path / "k2.csv"), summarize_kernels(
        [("nvjet_sm90_tst_192x192", 300.0), ("triton_poi_fused_add_7", 80.0), ("gatherTopK", 9.0)] * 2, steps=2,
        top=None))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_table_diff.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "k.csv"), str(tmp_path / "k2.csv")],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    kernels = {line.split()[-1]: float(line.split()[0]) for line in out if line.startswith((" ", "-"))}
    assert kernels == pytest.approx({"triton_poi_fused_add": 0.03, "gatherTopK": 0.009, "nvjet_sm90_tst_192x192": 0.0,
                                     long_name[:120].split()[-1]: -0.008})
    total = next(line for line in out if line.startswith("total")).split()
    assert [float(v) for v in total[1:]] == pytest.approx([0.358, 0.389])


def test_decode_rate_counts_only_the_steady_one_token_steps(monkeypatch):
    """A model whose one-token step takes 10 ms and whose prefill takes 300 ms: the rate is batch /
    10 ms, whatever the prefill costs (counted, it would pull the rate below 32 tokens / 0.38 s)."""
    import time

    from hydra_lm.diagnostics import bench
    from hydra_lm.model import decode_session

    model = hydra_lm.create_model("debug", vocab_size=512, max_seq_len=64).eval()
    steps = []

    def forward_cached(ids, start, caches, compiled=False, valid=None):
        steps.append(ids.shape[1])
        time.sleep(0.3)
        return torch.zeros(ids.shape[0], 512)

    class Step:  # stands for DecodeStep: runs 3 routed units per step, reads 2 decisions back
        def __init__(self, model, caches, batch, device, graphed, compiled, device_decisions=None):
            self.unit_calls = self.readbacks = 0
            self.device_decisions = False

        def __call__(self, ids, position):
            steps.append(ids.shape[1])
            self.unit_calls += 3
            self.readbacks += 2
            time.sleep(0.01)
            return torch.zeros(ids.shape[0], 512)

        def autocast(self):  # the session prefills under the step's autocast
            return contextlib.nullcontext()

    monkeypatch.setattr(model, "forward_cached", forward_cached)
    monkeypatch.setattr(decode_session, "DecodeStep", Step)
    rate, units, reads, on_device = bench.decode_tokens_per_s(model, batch=4, length=8, device=torch.device("cpu"),
                                                   compiled=False, repeats=2)
    assert 4 / 0.02 < rate <= 4 / 0.01 and units == 3 and reads == 2 and not on_device
    # prefill, two warm-up steps, then each timed run of 8 steps after a prefill of its own
    assert steps == [8] + [1] * 2 + ([8] + [1] * 8) * 2


def test_the_prefill_rate_times_generates_prefill_into_a_fresh_cache(monkeypatch):
    """The bench's prefill is what ``generate`` runs, ``forward_cached`` from position 0 into a cache of the
    prompt's length that every call finds zeroed (not a plain forward, which writes no cache): two warm-ups
    (on CUDA the first compiles, the second captures), then the timed calls."""
    from hydra_lm.diagnostics import bench

    model = hydra_lm.create_model("debug", vocab_size=512, max_seq_len=64).eval()
    calls = []

    def forward_cached(ids, start, caches, compiled=False, valid=None):
        k = caches[0][0][0].k
        assert valid is None  # launched as it is: a CPU session graphs no prefill
        calls.append((tuple(ids.shape), start, k.shape[2], bool(k.eq(0).all()), compiled))
        k.fill_(1.0)
        return torch.zeros(ids.shape[0], 512)

    monkeypatch.setattr(model, "forward_cached", forward_cached)
    for compiled in (False, True):  # generate's prefill compiles its units when its step compiles
        calls.clear()
        rate = bench.prefill_tokens_per_s(model, torch.zeros(8, 16, dtype=torch.long), torch.device("cpu"), compiled,
                                          repeats=3)
        assert rate > 0 and calls == [((8, 16), 0, 16, True, compiled)] * 5


def test_datasheet_peak_tells_the_pcie_and_nvl_cards_from_the_sxm_ones(monkeypatch):
    from hydra_lm.diagnostics.bench import datasheet_peak

    peaks = {}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA H200",
                 "NVIDIA L4"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        peaks[name] = datasheet_peak(torch.device("cuda"))
    assert list(peaks.values()) == [989.0, 756.0, 835.0, 835.0, 989.0, None]

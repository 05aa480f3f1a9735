"""`hydra-lm info --memory`: optimizer state counted exactly, the peak within 15% of a measured CPU run."""

import json
import os
import subprocess
import sys

import pytest
import torch

from support import tiny_model
from hydra_lm.cli import main
from hydra_lm.config import preset_config
from hydra_lm.train.memory_estimate import estimate_training_memory, measure_training_memory, optimizer_state_bytes
from hydra_lm.train.optim import build_optimizer
from hydra_lm.train.options import TrainConfig

# Peak RSS (KiB, Linux) of two fp32 training steps of the debug preset, less the RSS after the imports. The peak
# is the process's own memory's (VmHWM, new at exec): ru_maxrss would keep the forking test process's RSS when
# that was larger. Arguments: batch, length, vocabulary, gradient checkpointing (0/1), MoD and MoR on (0/1), MoE (0/1).
MEASURE = """
import json, os, sys, torch
from hydra_lm.config import preset_config
from hydra_lm.model import HydraModel
b, t, v, checkpointing, mod, mor, moe = map(int, sys.argv[1:])
torch.manual_seed(0)
with open("/proc/self/statm") as f:  # resident now (ru_maxrss would be the import's peak)
    base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024
model = HydraModel(preset_config("debug", vocab_size=v, max_seq_len=2048, moe=bool(moe)))
model.gradient_checkpointing = bool(checkpointing)
model.set_curriculum(bool(mod), bool(mor))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, v, (b, t))
for _ in range(2):
    model(ids, targets=ids)["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps((peak - base) / 1024))
"""


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "adafactor"])
def test_optimizer_state_matches_what_the_optimizer_allocates(optimizer):
    model = tiny_model()
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer, lr=1e-3), torch.device("cpu"))
    model(torch.randint(0, 97, (2, 16)), targets=torch.randint(0, 97, (2, 16)))["loss"].backward()
    opt.step()
    allocated = sum(v.numel() * v.element_size() for state in opt.state.values() for k, v in state.items()
                    if isinstance(v, torch.Tensor) and k != "step")
    assert optimizer_state_bytes(model, optimizer) == allocated


@pytest.mark.slow  # a 4 x 1024 training run in a subprocess: ~10-30 s on 2 cores
@pytest.mark.parametrize("checkpointing, mod, mor, moe", [(False, True, True, False), (True, True, True, False),
                                                       (False, False, False, False), (False, True, True, True)],
                         ids=["routed", "checkpointed", "dense", "moe"])
def test_peak_estimate_is_within_15_percent_of_a_measured_cpu_run(checkpointing, mod, mor, moe):
    """Checkpointed: backward recomputes a block's saved tensors and holds them while it runs through the block
    (the estimate without them was 2.2x low). Dense: the routers off, as a curriculum's first steps may be (1.9x
    the routed peak). MoE: its experts' loop reads row offsets, which the fake pass has none of (it failed)."""
    shape = (4, 1024, 2048)  # activations dominate, as in real runs; small shapes are mostly allocator noise
    # A fixed mmap threshold makes glibc return freed blocks, so the peak RSS is the peak in use.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", MEASURE, *map(str, shape), *(str(int(x)) for x in (checkpointing,
                          mod, mor, moe))], env=env, capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout)
    cfg = preset_config("debug", vocab_size=shape[2], moe=moe)
    estimate = measure_training_memory(cfg, shape[0], shape[1], "adamw", gradient_checkpointing=checkpointing,
                                       curriculum=(mod, mor, 1.0))["peak_mb"]
    assert abs(estimate - measured) / measured < 0.15, (estimate, measured)


def test_the_estimate_follows_the_routing_curriculum_and_a_built_models_state():
    """MoD off sends every token through every block, MoR off every token through every recursion: more saved
    activations than routed, the most with both off; a built model is estimated in its curriculum as it stands."""
    from hydra_lm.train.memory_estimate import compute_memory_footprint

    cfg = preset_config("debug", vocab_size=512)
    mb = {state: measure_training_memory(cfg, 2, 256, curriculum=state)["activations_mb"]
          for state in [(True, True, 1.0), (False, True, 1.0), (True, False, 1.0), (False, False, 1.0),
                        (True, True, 0.25)]}
    routed, dense = mb[(True, True, 1.0)], mb[(False, False, 1.0)]
    assert routed < mb[(False, True, 1.0)] < dense and routed < mb[(True, False, 1.0)] < dense
    assert routed < mb[(True, True, 0.25)] < mb[(True, False, 1.0)]  # the MoR ramp's first level: near full depth
    model = tiny_model()
    routed_model = compute_memory_footprint(model, 2, 64)
    model.set_curriculum(False, False)
    assert compute_memory_footprint(model, 2, 64) == measure_training_memory(model.config, 2, 64,
                                                                             curriculum=(False, False, 1.0))
    assert compute_memory_footprint(model, 2, 64)["activations_mb"] > routed_model["activations_mb"]


def test_the_cuda_estimate_saves_a_bf16_copy_of_a_shared_weight_per_use():
    """The trainer's autocast runs with its cast cache off (step.TrainStep.autocast), so a layer the recursions
    share is cast, and its cast saved, once per recursion: the estimate's activations are those of such a pass,
    not of one that casts each weight once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hydra_lm.model import HydraModel

    cfg = preset_config("debug", vocab_size=512)

    def saved_mb(cache: bool) -> float:
        saved = {}

        def keep(t):
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with FakeTensorMode():
            model = HydraModel(cfg)
            model.ce_impl = "chunked"
            ids = torch.zeros(2, 64, dtype=torch.long)
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache), \
                    torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                model(ids, targets=ids)
        return sum(saved.values()) / 2 ** 20

    uncached = saved_mb(cache=False)
    assert uncached > saved_mb(cache=True) + 1  # the recursions' casts: a few MB of the preset's weights
    assert measure_training_memory(cfg, 2, 64, device="cuda")["activations_mb"] == pytest.approx(uncached)


def test_info_prints_the_memory_breakdown(capsys):
    assert main(["info", "--model_size", "debug", "--memory", "--batch_size", "2", "--seq_len", "64",
                 "--optimizer", "lion", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "batch 2 x 64, lion, on cpu (fp32, plain loss): peak about" in out and "saved activations" in out


def test_the_cuda_estimate_counts_bf16_activations_and_the_fused_loss():
    cpu = estimate_training_memory("debug", 4, 256, "adamw", vocab_size=8192, device="cpu")
    cuda = estimate_training_memory("debug", 4, 256, "adamw", vocab_size=8192, device="cuda")
    assert cuda["weights_mb"] == cpu["weights_mb"] and cuda["optimizer_mb"] == cpu["optimizer_mb"]  # fp32 master
    # bf16 matmul outputs and no full [B, T, V] logits kept: well under the fp32 count, above a quarter of it.
    assert 0.25 * cpu["activations_mb"] < cuda["activations_mb"] < 0.8 * cpu["activations_mb"]
    # The working set: the fused loss's chunk of bf16 logits and their gradient, of 4,096 rows or the batch's fewer (a
    # routed, tied model keeps the gradient for the head's GEMMs: head_gradient_mb); without the fused loss
    # (--no-chunked_ce) the whole batch's fp32 logits and bf16 gradient, and its logits are kept for the backward.
    assert 4 * 256 * 8192 * 2 / 2**20 <= cuda["backward_mb"] < 4096 * 8192 * 6 / 2**20
    big = estimate_training_memory("debug", 8, 1024, "adamw", vocab_size=8192, device="cuda")
    wide_vocab = preset_config("debug", vocab_size=32768)  # the loss's chunk larger than twice any saved tensor
    assert measure_training_memory(wide_vocab, 8, 1024, device="cuda")["backward_mb"] == pytest.approx(
        4096 * 32768 * 2 / 2**20)
    assert measure_training_memory(wide_vocab.replace(arch="dense"), 8, 1024, device="cuda")["backward_mb"] == \
        pytest.approx(4096 * 32768 * 4 / 2**20)
    cfg = preset_config("debug", vocab_size=8192)
    plain = measure_training_memory(cfg, 8, 1024, device="cuda", fused_loss=False)
    assert plain["backward_mb"] >= 8 * 1024 * 8192 * 6 / 2**20
    assert plain["activations_mb"] > big["activations_mb"] + 8 * 1024 * 8192 * 2 / 2**20  # the bf16 logits kept
    # The fused loss of a routed, tied model keeps its chunks' bf16 logit gradients and hidden rows (width 512) for
    # the head's gradient (model/head_gradient_overlap.py): every chunk while the gradients fit in OVERLAP_BYTES, the
    # last ones after that.
    assert big["head_gradient_mb"] == pytest.approx(8 * 1024 * (8192 + 512) * 2 / 2**20)
    assert plain["head_gradient_mb"] == cpu["head_gradient_mb"] == 0
    assert measure_training_memory(cfg.replace(tie_embeddings=False), 8, 1024, device="cuda")["head_gradient_mb"] == 0
    assert measure_training_memory(preset_config("debug", vocab_size=8192, arch="dense"), 8, 1024,
                                   device="cuda")["head_gradient_mb"] == 0  # no routed units: nothing kept
    # 2 GiB holds 10,733 rows of 100,032 (the vocabulary padded to 64): the last two whole chunks of 4,096
    wide = measure_training_memory(preset_config("debug", vocab_size=100000), 32, 1024, device="cuda")
    assert wide["head_gradient_mb"] == pytest.approx(2 * 4096 * (100032 + 512) * 2 / 2**20)
    # 16,000 rows in chunks of 4,096, the last of 3,712: a budget of 1,024 rows keeps nothing (never a negative
    # count), one of 4,096 rows the last chunk; 120 rows in chunks of 32, the last of 24: 24 rows' worth keeps it
    from hydra_lm.model.head_gradient_overlap import first_kept_row
    assert first_kept_row(16000, 4096, 2 << 20, 2 << 30) == 16000
    assert first_kept_row(16000, 4096, 2 << 20, 4096 * (2 << 20)) == 12288
    assert first_kept_row(120, 32, 4, 24 * 4) == 96 and first_kept_row(120, 32, 4, 23 * 4) == 120
    assert measure_training_memory(cfg.replace(arch="dense"), 8, 1024, device="cuda", ce_chunk_size=8192)[
        "backward_mb"] == pytest.approx(8192 * 8192 * 4 / 2**20)
    # Sophia-G's Hessian estimate materialises the batch's logits (fp32, their softmax and gradient).
    sophia = estimate_training_memory("debug", 4, 256, "sophia", vocab_size=8192, device="cuda")
    assert sophia["activations_mb"] == cuda["activations_mb"]
    assert sophia["backward_mb"] == max(cuda["backward_mb"], 4 * 256 * 8192 * 12 / 2**20)
    long = estimate_training_memory("debug", 8, 1024, "sophia", vocab_size=8192, device="cuda")
    assert long["backward_mb"] == pytest.approx(8 * 1024 * 8192 * 12 / 2**20)  # more than a loss chunk
    with pytest.raises(ValueError, match="--device 'tpu'"):
        estimate_training_memory("debug", 4, 256, device="tpu")


def test_the_cuda_estimate_keeps_the_graphed_muon_steps_working_memory():
    """On CUDA Muon's step replays as a graph whose memory stays allocated: 8 bytes per weight of the
    largest group of equal-shaped hidden matrices (the debug preset's fused SwiGLU input weights)."""
    from hydra_lm import create_model

    model = create_model("debug", vocab_size=8192)
    largest = max(sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n
                      and p.shape == shape)
                  for shape in {p.shape for p in model.parameters() if p.dim() == 2})
    muon = estimate_training_memory("debug", 4, 256, "muon", vocab_size=8192, device="cuda")
    assert muon["update_mb"] == pytest.approx(8 * largest / 2**20)
    assert muon["peak_mb"] == pytest.approx(sum(v for k, v in muon.items() if k != "peak_mb"))
    assert estimate_training_memory("debug", 4, 256, "muon", vocab_size=8192, device="cpu")["update_mb"] == 0
    assert estimate_training_memory("debug", 4, 256, "adamw", vocab_size=8192, device="cuda")["update_mb"] == 0

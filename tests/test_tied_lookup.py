"""The tied lookup's gradient added into the head's in place (model/tied_lookup.py) through the sorted row-add kernel
(kernels/sorted_index_add.py): the kernel against a float64 ``index_add_``, bit for bit the same on every call, with
tokens frequent enough to span many of its chunks; and a tied model's gradients with it against autograd's own. On a
CPU under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1)."""

import pytest
import torch
import torch.nn.functional as F

from support import tiny_model

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("rows,width,kinds,hot", [(300, 130, 1000, 0.0), (300, 16, 5, 0.8), (65, 40, 3, 0.0),
                                                  (1, 8, 4, 0.0)],
                         ids=["distinct", "one_token_spans_chunks", "few_kinds", "one_row"])
def test_sorted_rows_add_like_index_add_and_repeat_their_bits(rows, width, kinds, hot):
    from hydra_lm.kernels.sorted_index_add import sorted_index_add_

    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, kinds, (rows,), generator=g)
    index[torch.rand(rows, generator=g) < hot] = 1
    src = torch.randn(rows, width, generator=g).to(DEVICE)
    out = torch.randn(kinds + 3, width, generator=g).to(DEVICE)
    index = index.to(DEVICE)
    expected = out.double().index_add_(0, index, src.double())
    first = sorted_index_add_(out.clone(), index, src)
    second = sorted_index_add_(out.clone(), index, src)
    assert torch.equal(first, second)
    torch.testing.assert_close(first.double(), expected, rtol=0, atol=1e-5 * max(1.0, (index == 1).sum().item()))
    untouched = torch.ones(kinds + 3, dtype=torch.bool, device=DEVICE)
    untouched[index] = False
    assert torch.equal(first[untouched], out[untouched])


def test_sorted_rows_add_into_bf16_sums_in_fp32_and_rounds_once():
    # What FSDP2's bf16 parameters would hand it: bf16 rows added into a bf16 gradient, within one bf16 step of the
    # exact sum (one rounding; the interpreter's conversion may truncate).
    from hydra_lm.kernels.sorted_index_add import sorted_index_add_

    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 6, (70,), generator=g).to(DEVICE)
    src = torch.randn(70, 24, generator=g).bfloat16().to(DEVICE)
    out = torch.randn(8, 24, generator=g).bfloat16().to(DEVICE)
    exact = out.double().index_add_(0, index, src.double())
    got = sorted_index_add_(out.clone(), index, src)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-6)


def test_sorted_rows_add_rejects_mismatched_shapes():
    from hydra_lm.kernels.sorted_index_add import sorted_index_add_

    with pytest.raises(ValueError, match="need out"):
        sorted_index_add_(torch.zeros(4, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2, 4))


def test_float64_weights_keep_index_add():
    """The kernel sums in fp32: a float64 model's lookup gradient goes through autograd's own (CUDA tensors stood in
    for by their attributes, so that the gate is checked on a CPU too)."""
    from types import SimpleNamespace

    from hydra_lm.model.tied_lookup import kernel_applies

    assert kernel_applies(SimpleNamespace(is_cuda=True, dtype=torch.float32))
    assert not kernel_applies(SimpleNamespace(is_cuda=True, dtype=torch.float64))


def _tied_grads(monkeypatch, kernel: bool, ce_impl: str = "chunked", micro_batches: int = 1, together: bool = False):
    from hydra_lm.kernels import sorted_index_add
    from hydra_lm.model import hydra

    monkeypatch.setattr(hydra, "kernel_applies", lambda weight: kernel)
    calls = []
    monkeypatch.setattr(sorted_index_add, "sorted_index_add_",
                        lambda *args, add=sorted_index_add.sorted_index_add_: calls.append(1) or add(*args))
    model = tiny_model(seed=3).to(DEVICE)
    model.ce_impl = ce_impl
    g = torch.Generator().manual_seed(1)
    total = 0.0
    for _ in range(micro_batches):
        ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=g)
        ids[:, ::3] = 5  # a frequent token
        out = model(ids.to(DEVICE), targets=torch.roll(ids, -1, 1).to(DEVICE))
        if together:  # forwards first, one backward through all of them: each lookup adds into its own loss's
            total = total + out["loss"]
        else:
            (out["loss"] * 0.5).backward()  # an upstream factor the head's gradient carries
    if together:
        total.backward()
    assert len(calls) == (micro_batches if kernel and ce_impl != "naive" else 0)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("micro_batches,together", [(1, False), (2, False), (2, True)],
                         ids=["one_backward", "accumulated", "two_forwards_one_backward"])
def test_a_tied_model_gets_autograds_gradients_with_the_lookup_added_into_the_head(monkeypatch, micro_batches,
                                                                                    together):
    got = _tied_grads(monkeypatch, kernel=True, micro_batches=micro_batches, together=together)
    expected = _tied_grads(monkeypatch, kernel=False, micro_batches=micro_batches, together=together)
    assert got.keys() == expected.keys() and "embed.weight" in got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_without_a_head_gradient_the_lookup_backward_is_the_embeddings(monkeypatch):
    from hydra_lm.model.tied_lookup import HeadGradientSlot, tied_lookup

    weight = torch.randn(11, 6, device=DEVICE, requires_grad=True)
    ids = torch.tensor([[1, 3, 3, 10]], device=DEVICE)
    upstream = torch.randn(1, 4, 6, device=DEVICE)
    slot = HeadGradientSlot(overlap=False)
    (tied_lookup(ids, weight, slot) * upstream).sum().backward()
    expected = torch.zeros(11, 6, device=DEVICE).index_add_(0, ids[0], upstream[0])
    torch.testing.assert_close(weight.grad, expected)
    # The naive loss path leaves the slot out: the same gradients as without the kernel.
    naive = _tied_grads(monkeypatch, kernel=True, ce_impl="naive")
    reference = _tied_grads(monkeypatch, kernel=False, ce_impl="naive")
    assert all(torch.equal(naive[name], reference[name]) for name in reference)


def test_the_loss_hands_its_head_gradient_to_the_lookup_which_returns_it():
    from hydra_lm.model.loss import chunked_linear_cross_entropy
    from hydra_lm.model.tied_lookup import HeadGradientSlot, tied_lookup

    weight = torch.randn(13, 8, device=DEVICE, requires_grad=True)
    hidden = torch.randn(5, 8, device=DEVICE)
    targets = torch.randint(0, 13, (5,), device=DEVICE)
    expected = torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), targets), weight)[0]
    # Hidden states that need no gradient: no backward would reach a lookup, so the loss keeps its gradient.
    slot = HeadGradientSlot(overlap=True)
    chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=2, grad_sink=slot).backward()
    assert slot.take() is None
    torch.testing.assert_close(weight.grad, expected)
    weight.grad = None
    hidden.requires_grad_()
    chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=2, grad_sink=slot).backward()
    handed = slot.take()
    assert weight.grad is None  # left for the lookup to return
    torch.testing.assert_close(handed, expected)
    # The lookup returns that very tensor, and autograd makes it the gradient without a copy (no other reference
    # to it left, as in the model).
    ids = torch.tensor([[2, 2, 7]], device=DEVICE)
    memory = handed.data_ptr()
    slot.put(handed)
    del handed
    (tied_lookup(ids, weight, slot) * 1.5).sum().backward()
    assert weight.grad.data_ptr() == memory
    expected[2] += 3.0
    expected[7] += 1.5
    torch.testing.assert_close(weight.grad, expected)


@pytest.mark.parametrize("budget_chunks", [1, 3, 9])
def test_the_head_gradients_gemms_left_to_the_backward_give_the_forwards_gradients(monkeypatch, budget_chunks):
    """The bookkeeping of ``head_gradient_overlap`` on the CPU, its side stream stood in for (the stream itself is the
    GPU test below): with the last 1, 3 or all chunks' GEMMs left to the backward, a tied model's gradients are the
    same bits as with every GEMM in the forward, through an upstream factor and two accumulated micro-batches, and the
    lookup's backward joins the work once per forward."""
    import contextlib

    from hydra_lm.model import head_gradient_overlap as overlap_module
    from hydra_lm.model import hydra

    joins = []

    class Stream:
        def wait_stream(self, other):
            joins.append(isinstance(other, Stream))

    monkeypatch.setattr(hydra, "kernel_applies", lambda weight: True)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())

    def grads(budget: int, **overrides) -> dict:
        monkeypatch.setattr(overlap_module, "side_stream", lambda device: Stream() if budget else None)
        monkeypatch.setattr(overlap_module, "OVERLAP_BYTES", budget)
        model = tiny_model(seed=3, **overrides).to(DEVICE)
        model.ce_impl, model.ce_chunk_size = "chunked", 32  # 120 tokens a batch: chunks of 32, 32, 32 and 24 rows
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=g)
            (model(ids.to(DEVICE), targets=torch.roll(ids, -1, 1).to(DEVICE))["loss"] * 0.5).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected = grads(0)
    padded_row = -(-tiny_model(seed=3).config.vocab_size // 64) * 64 * 4  # fp32 logit gradients on the CPU
    got = grads(budget_chunks * 32 * padded_row)
    # each backward forks the work (the side stream waits on the trunk's) and the lookup joins it (the reverse)
    assert len(joins) == 4
    assert got.keys() == expected.keys() and "embed.weight" in got
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    # Without routed units (a dense model's backward keeps the GPU busy) every GEMM stays in the forward.
    joins.clear()
    grads(budget_chunks * 32 * padded_row, mod_enabled=False, mor_enabled=False)
    grads(budget_chunks * 32 * padded_row, arch="dense", n_layers=2, n_heads=4, n_kv_heads=2)
    assert not joins


def test_a_head_gradient_work_that_no_lookup_joins_joins_when_freed_and_a_second_backward_is_refused(monkeypatch):
    """A backward that stops short of the tied lookup (here ``autograd.grad`` of the hidden states only) leaves the
    side stream's GEMMs forked: freeing the work must make the trunk's stream wait for them, or the allocator could hand
    their operands to later kernels while they still run. A second backward through the loss (``retain_graph``) finds
    those operands gone and says so."""
    import contextlib
    import gc

    from hydra_lm.model import head_gradient_overlap as overlap_module
    from hydra_lm.model.loss import chunked_linear_cross_entropy
    from hydra_lm.model.tied_lookup import HeadGradientSlot

    waits = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            waits.append(f"{self.name} waits on {other.name}")

    trunk, side = Stream("trunk"), Stream("side")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: trunk)
    monkeypatch.setattr(overlap_module, "side_stream", lambda device: side)
    torch.manual_seed(0)
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (40,))

    slot = HeadGradientSlot(overlap=True)
    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=16, grad_sink=slot)
    torch.autograd.grad(loss, hidden)
    assert waits == ["side waits on trunk"]  # forked, and nothing took the slot's work
    del slot, loss
    gc.collect()
    assert waits == ["side waits on trunk", "trunk waits on side"]

    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=16, grad_sink=HeadGradientSlot(True))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", ["every_chunk", "last_chunk"])
def test_the_head_gradient_run_beside_the_trunks_backward_matches_the_forwards_and_replays_in_a_cuda_graph(
        monkeypatch, overlap):
    """The fused loss's head-gradient GEMMs left to its backward (``head_gradient_overlap.HeadGradientWork``: a green
    context's stream, joined by the tied lookup's backward) give the gradients of the same GEMMs run in the forward,
    eagerly and replayed from a captured step, and the side stream's work is part of the capture (a replay on other
    targets gives the eager step's gradients there)."""
    from hydra_lm.model import head_gradient_overlap as overlap_module
    from hydra_lm.model import loss
    from hydra_lm.model.cuda_graphs import GraphedStep
    from hydra_lm.model.tied_lookup import HeadGradientSlot, tied_lookup

    if overlap_module.side_stream(torch.device("cuda")) is None:
        pytest.skip("no CUDA green context on this GPU, torch build or driver: the GEMMs stay in the forward")
    torch.manual_seed(0)
    vocab, width, chunk = 1000, 64, 256
    weight = torch.nn.Parameter(torch.randn(vocab, width, device="cuda") * 0.1)
    trunk = torch.nn.Linear(width, width, device="cuda")
    ids = torch.randint(0, vocab, (4, chunk), device="cuda")
    targets = torch.randint(0, vocab, (4, chunk), device="cuda")
    params = [weight, *trunk.parameters()]
    launched, launch = [], overlap_module.HeadGradientWork.launch
    monkeypatch.setattr(overlap_module.HeadGradientWork, "launch",
                        lambda self, g: launched.append(len(self.chunks)) or launch(self, g))

    def step():
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        slot = HeadGradientSlot(overlap=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            h = trunk(tied_lookup(ids, weight, slot))
            out = loss.chunked_linear_cross_entropy(h, weight, targets, chunk_size=chunk, grad_sink=slot)
        (out * 0.5).backward()
        return out

    monkeypatch.setattr(overlap_module, "OVERLAP_BYTES", 0)
    step()
    expected = [p.grad.clone() for p in params]
    assert not launched
    padded = -(-vocab // loss.VOCAB_ALIGN) * loss.VOCAB_ALIGN
    monkeypatch.setattr(overlap_module, "OVERLAP_BYTES", 2 << 30 if overlap == "every_chunk" else chunk * padded * 2)
    step()
    assert launched == [4 if overlap == "every_chunk" else 1]
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-7)
    graphed = GraphedStep(step, warmup=2)
    for _ in range(3):  # two eager warm-up steps, then the capture and its replay
        graphed()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-7)
    before = weight.grad.clone()
    targets.copy_(torch.randint(0, vocab, targets.shape, device="cuda"))
    graphed()
    replayed = [p.grad.clone() for p in params]
    monkeypatch.setattr(overlap_module, "OVERLAP_BYTES", 0)
    step()
    assert not torch.equal(replayed[0], before)
    for r, p in zip(replayed, params):
        torch.testing.assert_close(r, p.grad, rtol=1e-6, atol=1e-7)


def test_the_head_gradients_side_stream_is_a_green_context_of_all_but_the_trunks_sms_or_none(monkeypatch):
    """Where the head's GEMMs may leave the forward (model/head_gradient_overlap.py): never off CUDA; on a GPU a green
    context of all but ``TRUNK_SMS`` SMs, made once and kept (its stream dies with it); none on a GPU too small to
    spare them, or where torch or the driver cannot make one (the GEMMs then stay in the forward)."""
    from types import SimpleNamespace

    from torch.cuda import green_contexts

    from hydra_lm.model import head_gradient_overlap as overlap_module

    assert overlap_module.side_stream(torch.device("cpu")) is None
    made = []

    class Context:
        def Stream(self):
            return ("stream of", self)

    def create(num_sms, device_id):
        made.append((num_sms, device_id))
        if gpu.fails:
            raise RuntimeError("green contexts need CUDA 12.4")
        return Context()

    gpu = SimpleNamespace(multi_processor_count=132, fails=False)
    monkeypatch.setattr(green_contexts.GreenContext, "create", staticmethod(create))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpu)
    for gpu.multi_processor_count, gpu.fails, ok in [(132, False, True), (60, False, False), (132, True, False)]:
        monkeypatch.setattr(overlap_module, "_streams", {})
        made.clear()
        stream = overlap_module.side_stream(torch.device("cuda", 1))
        if not ok:
            assert stream is None and made == ([(100, 1)] if gpu.fails else [])  # asked only where the SMs suffice
        else:
            assert made == [(100, 1)] and stream[0] == "stream of"
            assert overlap_module._streams[1][0] is stream[1]  # the context is kept beside its stream
            assert overlap_module.side_stream(torch.device("cuda", 1)) is stream and len(made) == 1  # made once

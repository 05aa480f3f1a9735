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
    slot = HeadGradientSlot()
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
    slot = HeadGradientSlot()
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

"""The fused loss's row kernel (kernels/cross_entropy_rows.py) against PyTorch: each row's cross-entropy and the
logit gradient, with padding columns past the vocabulary and ignored rows; and the chunked loss that runs it on
CUDA against the reference loss. On a CPU under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1)."""

import pytest
import torch
import torch.nn.functional as F

from hydra_lm.model import loss as lce

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(dtype, n=37, vocab=70, padded=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, padded, generator=g) * 4).to(dtype)
    logits[:, vocab:] = 1e4  # padding columns: the kernel must not read them as logits
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::5] = -100
    return logits.to(DEVICE), targets.to(DEVICE)


@pytest.mark.parametrize("block", [16, None], ids=["five_column_blocks", "one_block"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_rows_match_cross_entropy_and_its_logit_gradient(dtype, tol, block, monkeypatch):
    from hydra_lm.kernels import cross_entropy_rows as kernel

    if block is not None:
        monkeypatch.setattr(kernel, "_BLOCK", block)
    vocab = 70
    logits, targets = _case(dtype, vocab=vocab)
    scale = torch.tensor(0.25, device=DEVICE)
    loss, grad = kernel.cross_entropy_rows(logits, targets, scale, vocab, -100, True)

    ref = logits[:, :vocab].float().detach().requires_grad_()
    rows = F.cross_entropy(ref, targets, ignore_index=-100, reduction="none")
    (rows.sum() * scale).backward()
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss, rows.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad[:, :vocab].float(), ref.grad, rtol=tol, atol=tol * 0.25)
    assert not grad[:, vocab:].any(), "padding columns get no gradient"
    assert not grad[targets == -100].any() and not loss[targets == -100].any(), "ignored rows count nothing"
    assert grad[targets != -100].any()

    no_grad_loss, empty = kernel.cross_entropy_rows(logits, targets, scale, vocab, -100, False)
    assert empty.numel() == 0
    torch.testing.assert_close(no_grad_loss, loss, rtol=0, atol=0)


def test_the_chunked_loss_through_the_kernel_matches_the_reference(monkeypatch):
    from hydra_lm.kernels import cross_entropy_rows as kernel

    monkeypatch.setattr(lce, "_rows_kernel_applies", lambda hidden, acc_dtype: acc_dtype == torch.float32)
    calls = []
    original = kernel.cross_entropy_rows
    monkeypatch.setattr(kernel, "cross_entropy_rows", lambda *a: calls.append(1) or original(*a))
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(50, 8, generator=g).to(DEVICE).requires_grad_()
    weight = (torch.randn(37, 8, generator=g) * 0.5).to(DEVICE).requires_grad_()  # 37: padded to 64 columns
    targets = torch.randint(0, 37, (50,), generator=g).to(DEVICE)
    targets[16:32] = -100  # a whole chunk without a target
    got = lce.chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    assert len(calls) == 4, "every chunk of 16 rows runs the kernel"
    ref = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_target_outside_the_vocabulary_makes_its_row_nan_and_reads_nothing_out_of_bounds():
    from hydra_lm.kernels import cross_entropy_rows as kernel

    logits, targets = _case(torch.float32, n=6, vocab=70, padded=80)
    targets[:] = torch.tensor([3, 70, -100, 5000, -7, 4])  # 70 is a padding column, 5000 past the row's end
    loss, grad = kernel.cross_entropy_rows(logits, targets, torch.tensor(1.0, device=DEVICE), 70, -100, True)
    bad = torch.tensor([False, True, False, True, True, False], device=DEVICE)
    assert loss[bad].isnan().all() and loss[~bad].isfinite().all() and loss[2] == 0
    assert grad.isfinite().all() and not grad[:, 70:].any() and not grad[bad].any() and grad[~bad].any()


def test_targets_given_as_a_column_of_a_wider_tensor_are_read_row_by_row():
    from hydra_lm.kernels import cross_entropy_rows as kernel

    logits, targets = _case(torch.float32, n=9)
    pairs = torch.stack([targets, torch.full_like(targets, 7)], dim=1)  # targets[i] at offset 2 * i
    scale = torch.tensor(1.0, device=DEVICE)
    want = kernel.cross_entropy_rows(logits, targets, scale, 70, -100, True)
    got = kernel.cross_entropy_rows(logits, pairs[:, 0], scale, 70, -100, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_arguments_the_kernel_would_read_past_are_refused():
    """A vocabulary wider than the logits' columns read into the next row (or past the buffer), fewer targets than
    rows past the targets: a ValueError instead of numbers (or an illegal address on a GPU)."""
    from hydra_lm.kernels import cross_entropy_rows as kernel

    logits, targets = _case(torch.float32, n=4, vocab=70, padded=80)
    scale = torch.tensor(1.0, device=DEVICE)
    with pytest.raises(ValueError, match="need vocab <= the logits' columns and one target per row"):
        kernel.cross_entropy_rows(logits, targets, scale, 81, -100, True)
    with pytest.raises(ValueError, match="one target per row"):
        kernel.cross_entropy_rows(logits, targets[:1], scale, 70, -100, True)

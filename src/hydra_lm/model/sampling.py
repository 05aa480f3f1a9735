"""What ``generate`` takes and picks: prompts of several lengths as one padded batch, and next-token sampling
(greedy, temperature, top-k and nucleus, top-p)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch


def batch_prompts(prompts, device: torch.device, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of several lengths (an iterable of 1-D integer tensors or of sequences of ints) -> (ids [B, longest]
    with each row's prompt first and zeros after it, on ``device``; the lengths [B] on the CPU). ``vocab_size``:
    each prompt's ids checked to lie in [0, vocab_size) before the padding, and the error names the prompt."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be a [batch, length] tensor of token ids or a list of token id lists, not text")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must be a [batch, length] tensor or a non-empty list of token id lists")
    rows = []
    for i, prompt in enumerate(prompts):
        row = torch.as_tensor(prompt)
        if row.dim() != 1 or not row.numel():
            hint = " (one prompt as a list: pass [[ids...]] or a [1, length] tensor)" if row.dim() == 0 else ""
            raise ValueError(f"prompt {i} has shape {tuple(row.shape)}: each prompt must hold one or more token "
                             f"ids{hint}")
        if row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
            raise ValueError(f"prompt {i} holds {row.dtype} values: token ids must be integers")
        if vocab_size is not None:
            lo, hi = int(row.min()), int(row.max())
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"prompt {i}: token ids must lie in [0, {vocab_size}), got [{lo}, {hi}]")
        rows.append(row)
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row.to(device)
    return ids, lengths


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """A ValueError naming the first sampling argument ``sample_next`` cannot use. Any real / integral number
    serves (a NumPy scalar too; ``top_k`` also a 0-dim integer tensor), never a bool."""
    if not (_real(temperature) and 0 <= temperature < math.inf):
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and not ((k := as_integer(top_k)) is not None and k >= 1):
        raise ValueError(f"top_k={top_k!r} must be an integer >= 1")
    if top_p is not None and not (_real(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p!r} must lie in (0, 1]")


def check_generator(generator, rows: int) -> bool:
    """Whether ``generator`` is one per row (a sequence of ``rows`` generators); a ValueError if it is neither that,
    one ``torch.Generator`` nor None."""
    if generator is None or isinstance(generator, torch.Generator):
        return False
    if not (isinstance(generator, Sequence) and all(isinstance(g, torch.Generator) for g in generator)):
        raise ValueError(f"generator={generator!r}: pass a torch.Generator, a sequence of one per row, or None")
    if len(generator) != rows:
        raise ValueError(f"generator: a sequence of {len(generator)} generators for {rows} rows: pass one per row, "
                         "or one torch.Generator for the batch")
    return True


def as_integer(value) -> int | None:
    """``value`` as a Python int where it is an integer: any ``numbers.Integral`` (a NumPy integer too) or a 0-dim
    integer tensor; never a bool. None for anything else."""
    if isinstance(value, torch.Tensor):
        integral = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        return int(value) if value.dim() == 0 and integral else None
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None,
                generator: torch.Generator | Sequence[torch.Generator] | None = None) -> torch.Tensor:
    """Pick one token per row of ``logits`` [B, V]; ``temperature=0`` means argmax. ``top_k`` and ``top_p`` keep
    every token whose logit is at least the smallest one they keep: tokens tied with it at the boundary stay too,
    so top-k may keep more than k. ``generator``: one for the batch (its rows' draws follow each other, so a row's
    token depends on the rows before it) or a sequence of one per row (each row draws from its own alone)."""
    check_sampling(temperature, top_k, top_p)
    per_row = check_generator(generator, logits.shape[0])
    if temperature == 0:
        return logits.argmax(dim=-1)
    # Relative to each row's highest logit: a tiny temperature then drives the others to -inf, not the top to inf,
    # and the top stays 0 (0 / a temperature that rounds to 0 in fp32 would be NaN).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    logits = torch.where(shifted == 0, shifted, shifted / temperature)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, int(top_k), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token while the mass before it is below top_p (the first always stays); the kept ones are a prefix.
        kept = ((probs.cumsum(-1) - probs) < top_p).sum(-1, keepdim=True)
        logits = logits.masked_fill(logits < sorted_logits.gather(-1, kept - 1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if per_row:
        return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generator)])
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

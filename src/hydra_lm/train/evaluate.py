"""Validation loss with causal routing (the real autoregressive number) and with top-k routing.

Top-k routing picks a row's tokens after seeing the whole row, so its loss is teacher-forced and
can look better than what the model does when it generates. Each pass states its routing mode
explicitly; the causal pass never depends on ``model.eval_routing``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable

import torch

EVAL_MODES = ("causal", "topk")


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], device: torch.device,
             max_batches: int = 0, autocast: Callable[[], Any] = contextlib.nullcontext,
             use_doc_ids: bool = False, should_stop: Callable[[], bool] = lambda: False,
             reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float] | None:
    """Token-weighted mean CE over ``batches`` (all of them when ``max_batches`` is 0).

    Returns None when ``should_stop`` interrupts it (e.g. Ctrl-C), so no partial number is logged.
    ``reduce`` sums the totals over the ranks that evaluated their shares of the data.
    """
    was_training = model.training
    model.eval()
    totals = {mode: torch.zeros((), dtype=torch.float64, device=device) for mode in EVAL_MODES}
    exec_frac = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    n_batches = 0
    try:
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            if should_stop():
                return None
            x = batch["input_ids"].to(device, non_blocking=True)
            y = batch["targets"].to(device, non_blocking=True)
            kwargs = {"doc_ids": batch["doc_ids"].to(device, non_blocking=True)} if use_doc_ids else {}
            n = (y != -100).sum()
            for mode in EVAL_MODES:
                with autocast():
                    out = model(x, targets=y, routing=mode, **kwargs)
                totals[mode] += out["ce_loss"].double() * n
                if mode == "causal" and out["routing_stats"].numel():
                    exec_frac += out["routing_stats"][:, 0].double().mean()
            tokens += n
            n_batches += 1
    finally:
        model.train(was_training)
    summed = reduce(torch.stack([totals["causal"], totals["topk"], exec_frac, tokens,
                                 torch.tensor(float(n_batches), dtype=torch.float64, device=device)]))
    totals = {"causal": summed[0], "topk": summed[1]}
    exec_frac, tokens, n_batches = summed[2], summed[3], int(summed[4])
    if n_batches == 0:
        raise ValueError("the validation split yielded no batch: it is shorter than one batch of sequences "
                         "(prepare more data, raise the validation fraction, or lower --batch_size/--seq_len)")
    count = max(1.0, float(tokens))
    out = {"val_tokens": int(tokens), "val_batches": n_batches}
    for mode in EVAL_MODES:
        loss = float(totals[mode]) / count
        out[f"val_loss_{mode}"] = loss
        out[f"val_ppl_{mode}"] = math.exp(min(loss, 700.0))
    if model_has_routers(model):
        out["val_exec_frac_causal"] = float(exec_frac) / n_batches
    return out


def model_has_routers(model: torch.nn.Module) -> bool:
    names = getattr(model, "router_names", None)
    return bool(names()) if callable(names) else False

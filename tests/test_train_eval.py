"""Evaluation: the causal number is computed with causal routing only, whatever the model's defaults."""

import math

import pytest
import torch

import hydra_lm
from hydra_lm.model import routing
from hydra_lm.train import evaluate
from hydra_lm.train.evaluate import EVAL_MODES, decisions_per_row, format_eval, routing_warnings
from support import tokens_per_unit


def batches(n=3, b=2, t=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (b, t + 1), generator=g)
        y = ids[:, 1:].clone()
        y[0, -3:] = -100  # padding the loader may produce at the end of a pass
        out.append({"input_ids": ids[:, :-1], "targets": y, "doc_ids": torch.zeros(b, t, dtype=torch.int32)})
    return out


def tiny(**kw):
    torch.manual_seed(0)
    return hydra_lm.create_model("debug", **{**dict(vocab_size=50, dim=32, n_heads=2, n_kv_heads=1, mlp_hidden=64,
                                                    max_seq_len=32, mod_every=1, mod_capacity=0.5), **kw})


def test_causal_pass_never_routes_top_k(monkeypatch):
    model = tiny()
    model.eval_routing = "topk"  # a model whose eval default is top-k must still give a causal number
    events = []
    original_forward, original_select = model.forward, routing.ExpertChoiceRouter.select

    def forward(*args, routing=None, **kw):
        events.append(("forward", routing))
        return original_forward(*args, routing=routing, **kw)

    def select(self, x, valid, k, mode, row_len, **kw):
        events.append(("router", mode))
        return original_select(self, x, valid, k, mode, row_len, **kw)

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(routing.ExpertChoiceRouter, "select", select)
    result = evaluate(model, batches(), torch.device("cpu"))
    current, seen = None, {"causal": set(), "topk": set()}
    for kind, mode in events:
        if kind == "forward":
            current = mode
        else:
            seen[current].add(mode)
    assert seen == {"causal": {"causal"}, "topk": {"topk"}}
    assert [m for k, m in events if k == "forward"] == ["causal", "topk"] * 3
    assert model.training  # evaluate restores the mode it found
    assert result["val_loss_causal"] != result["val_loss_topk"]  # the routing really differs


def test_losses_are_token_weighted_means_and_training_mode_is_restored():
    model = tiny().train()
    data = batches()
    result = evaluate(model, data, torch.device("cpu"))
    assert model.training
    model.eval()
    with torch.no_grad():
        for mode in ("causal", "topk"):
            total = count = 0.0
            for b in data:
                out = model(b["input_ids"], targets=b["targets"], routing=mode)
                n = (b["targets"] != -100).sum().item()
                total += out["ce_loss"].item() * n
                count += n
            assert result[f"val_loss_{mode}"] == pytest.approx(total / count, rel=1e-6)
            assert result[f"val_ppl_{mode}"] == pytest.approx(math.exp(total / count), rel=1e-6)
    assert result["val_tokens"] == 3 * 2 * 16 - 3 * 3
    assert 0 < result["val_exec_frac_causal"] <= 1


def test_agreement_over_decisions_weighs_each_router_by_its_candidates():
    # MoD 0.5 on every second block, MoR keeping 1/2 per depth: routers decide on 16, 8 or 4 of a row's 16.
    model = tiny(n_blocks=2, recursions=3, mod_every=2, mor_capacity_schedule="geometric", mor_capacity=0.5)
    result = evaluate(model, batches(), torch.device("cpu"))
    tokens = tokens_per_unit(model, 16)
    candidates = {}
    for block in model.blocks:
        for name, depth in block.router_depths():
            candidates[name] = 16 if depth == 0 else tokens[f"{block.name}.depth{depth - 1}"]
    assert sorted(set(candidates.values())) == [4, 8, 16]
    agreements = {name: r["agreement"] for name, r in result["routing"].items()}
    assert len(set(agreements.values())) > 1  # the weighting can matter
    expected = sum(candidates[n] * a for n, a in agreements.items()) / sum(candidates.values())
    assert result["val_agreement_decisions"] == pytest.approx(expected, rel=1e-9)
    assert result["val_agreement"] == pytest.approx(sum(agreements.values()) / len(agreements), rel=1e-9)
    assert f"(of decisions {100 * expected:.1f}%)" in format_eval(result)


def test_routers_the_curriculum_keeps_off_count_in_neither_agreement():
    """A switched-off router lets every candidate through and decides nothing: it used to count as agreeing on all."""
    model = tiny(n_blocks=2, recursions=3, mor_capacity=0.5)
    model.set_curriculum(mod_active=False, mor_active=True)
    result = evaluate(model, batches(), torch.device("cpu"))
    routers = result["routing"]
    off = [name for name in routers if ".mod" in name]
    assert off and all(routers[n]["agreement"] is None and not routers[n]["active"] for n in off)
    on = {name: r["agreement"] for name, r in routers.items() if name not in off}
    assert result["val_agreement"] == pytest.approx(sum(on.values()) / len(on), rel=1e-9)
    weights = dict(zip(routers, decisions_per_row(list(routers), [r["exec_topk"] for r in routers.values()])))
    expected = sum(weights[n] * a for n, a in on.items()) / sum(weights[n] for n in on)
    assert result["val_agreement_decisions"] == pytest.approx(expected, rel=1e-9)
    model.set_curriculum(mod_active=False, mor_active=False)
    result = evaluate(model, batches(), torch.device("cpu"))
    assert "val_agreement" not in result and "val_agreement_decisions" not in result
    assert "agreement - (every router off)" in format_eval(result)


def test_a_router_kept_off_and_never_calibrated_leaves_the_calibrated_ones_warnings():
    """With MoR kept off (--mor_off) its routers never calibrate; MoD's routers, calibrated and drifted far above
    their threshold, still warn (one uncalibrated router used to silence every warning)."""
    model = tiny(recursions=2, mod_capacity=0.25)
    model.set_curriculum(mod_active=True, mor_active=False)
    model.train()
    for b in batches():  # training forwards calibrate the active routers' thresholds
        model(b["input_ids"], targets=b["targets"])
    for module in model.modules():
        if isinstance(module, routing.ExpertChoiceRouter) and module.kind == "mod":
            module.proj.bias.data += 5.0  # every logit far above the threshold: causal routing runs every token
    result = evaluate(model, batches(n=8, b=4), torch.device("cpu"))  # enough tokens to judge MoD's share (4x)
    mod = [name for name in result["routing"] if ".mod" in name]
    assert mod and [w.split()[1] for w in routing_warnings(result) if w.startswith("router")] == mod
    assert result["routing_calibrated"] and all(result["routing"][n]["calibrated"] for n in mod)
    assert not any(r["calibrated"] for name, r in result["routing"].items() if name not in mod)


def test_max_batches_stop_and_empty_split():
    model = tiny()
    assert evaluate(model, batches(n=5), torch.device("cpu"), max_batches=2)["val_batches"] == 2
    assert evaluate(model, batches(), torch.device("cpu"), should_stop=lambda: True) is None
    with pytest.raises(ValueError, match="no batch"):
        evaluate(model, [], torch.device("cpu"))


def _passes(rows: torch.Tensor, batch_size: int, pad_id: int = 0) -> list[dict]:
    """One pass over ``rows`` [R, T + 1] as the validation loader makes it: the last batch filled up with rows of
    padding only (pad_id inputs, every target -100)."""
    out = []
    for start in range(0, len(rows), batch_size):
        window = rows[start:start + batch_size]
        pad = batch_size - len(window)
        ids = torch.cat((window[:, :-1], torch.full((pad, rows.shape[1] - 1), pad_id)))
        y = torch.cat((window[:, 1:], torch.full((pad, rows.shape[1] - 1), -100)))
        out.append({"input_ids": ids, "targets": y, "doc_ids": torch.zeros_like(ids, dtype=torch.int32)})
    return out


def test_routing_stats_count_real_rows_only_whatever_the_batch_size():
    """The loss ignores the padding rows that fill the last batch; the routers' stats counted their routing, and every
    batch alike (a last batch of one real row weighed as a full one). Now the stats at every batch size are those of
    one forward on the real rows alone, and the loss is what it was."""
    model = tiny(n_blocks=2, recursions=2, mor_capacity=0.5)
    rows = torch.randint(1, 50, (7, 17), generator=torch.Generator().manual_seed(3))
    results = {b: evaluate(model, _passes(rows, b), torch.device("cpu")) for b in (2, 4, 7)}
    with torch.no_grad():
        model.eval()
        whole = {mode: model(rows[:, :-1], targets=rows[:, 1:], routing=mode) for mode in EVAL_MODES}
    for result in results.values():
        assert result["val_tokens"] == 7 * 16
        for mode in EVAL_MODES:
            assert result[f"val_loss_{mode}"] == pytest.approx(float(whole[mode]["ce_loss"]), rel=1e-6)
        for i, r in enumerate(result["routing"].values()):
            assert r["exec_causal"] == pytest.approx(float(whole["causal"]["routing_stats"][i, 0]), rel=1e-6)
            assert r["exec_topk"] == pytest.approx(float(whole["topk"]["routing_stats"][i, 0]), rel=1e-6)
            assert r["agreement"] == pytest.approx(float(whole["topk"]["routing_stats"][i, 2]), rel=1e-6)
    from hydra_lm.train.evaluate import real_rows

    full = _passes(rows, 7)[0]
    assert real_rows(full) == (full, 7)  # no padding: the batch itself runs, as before
    kept, count = real_rows(_passes(rows[:1], 3)[0])
    assert torch.equal(kept["input_ids"], rows[:1, :-1]) and count == 1
    padding = {key: value[1:] for key, value in _passes(rows[:1], 3)[0].items()}
    kept, count = real_rows(padding)  # a rank's share of padding only: one row runs, weighing nothing
    assert kept["targets"].shape == (1, 16) and count == 0


def test_a_top_k_over_row_groups_evaluates_a_last_batch_of_any_number_of_real_rows():
    """topk_groups pools the batch's rows in equal groups: a last batch trimmed to its 3 real rows of 4 did not split
    in 2 and the evaluation raised (under torchrun on one rank only, the others waiting in a collective). Padding rows
    fill its last group; the loss is that of the real rows."""
    model = tiny(topk_over="batch", topk_groups=2)
    rows = torch.randint(1, 50, (7, 17), generator=torch.Generator().manual_seed(3))
    result = evaluate(model, _passes(rows, 4), torch.device("cpu"))  # batches of 4 real rows, then 3 and 1 padding
    assert result["val_tokens"] == 7 * 16 and math.isfinite(result["val_loss_causal"])
    from hydra_lm.train.evaluate import real_rows

    kept, count = real_rows(_passes(rows, 4)[1], groups=2)
    assert count == 3 and kept["targets"].shape[0] == 4 and (kept["targets"][3] == -100).all()
    kept, count = real_rows(_passes(rows[:6], 12)[0], groups=4)  # 6 real rows of 12: two of padding fill a group
    assert count == 6 and kept["targets"].shape[0] == 8


def test_evaluate_gives_every_submodule_its_own_train_eval_flag_back():
    """The trainer's periodic evaluation must not unfreeze routers a user froze with ``.eval()`` (their threshold
    calibration stops) by restoring the top-level flag onto every module."""
    model = tiny().train()
    for block in model.blocks:
        for router in block.all_routers():
            router.eval()
    before = {name: m.training for name, m in model.named_modules()}
    assert len(set(before.values())) == 2
    evaluate(model, batches(), torch.device("cpu"))
    assert {name: m.training for name, m in model.named_modules()} == before

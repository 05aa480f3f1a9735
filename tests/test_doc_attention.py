"""Document-masked attention: FlexAttention's block-sparse path computes what the dense SDPA mask does.

FlexAttention has no backward on CPU, so the gradient checks lift its device check and run the
reference (unfused) implementation of the same operator; the block tables are checked against
``create_block_mask`` and through the compiled CPU kernel (forward), the fused GPU kernel in
tests/test_gpu.py.
"""

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F

from hydra_lm.model import doc_attention as da
from hydra_lm.model.attention import CCGQAttention, GQAttention
from hydra_lm.model.layers import RotaryEmbedding

from support import TINY, tiny_model


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)


def _qkv(b=2, h_q=4, h_k=2, n=300, d=16, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype).requires_grad_(grad) for h in (h_q, h_k, h_k)]


def _loader_docs(b, n, seed=0, mean=60):
    starts = torch.rand(b, n, generator=torch.Generator().manual_seed(seed)) < 1 / mean
    starts[:, 0] = False
    return starts.cumsum(1)


def _dense(q, k, v, doc):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=da.dense_doc_mask(doc), enable_gqa=True)


def test_dense_mask_is_causal_and_within_documents():
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    mask = da.dense_doc_mask(doc)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(mask, expected.bool())


@pytest.mark.parametrize("n", [300, 256, 40])
def test_block_mask_matches_the_exact_one_for_loader_ids(n):
    doc = _loader_docs(3, n)
    ours = da.doc_block_mask(doc)
    exact = flex_module.create_block_mask(lambda b, h, q, k: (k <= q) & (doc[b, q] == doc[b, k]), 3, None, n, n,
                                          device="cpu")
    assert torch.equal(ours.to_dense(), exact.to_dense())
    # A tile marked full skips the mask, so it must really be all allowed.
    dense = F.pad(da.dense_doc_mask(doc)[:, 0], (0, ours.kv_num_blocks.shape[-1] * 128 - n) * 2)
    for row in range(3):
        for qt in range(ours.full_kv_num_blocks.shape[-1]):
            for kt in ours.full_kv_indices[row, 0, qt, :int(ours.full_kv_num_blocks[row, 0, qt])].tolist():
                assert dense[row, qt * 128:(qt + 1) * 128, kt * 128:(kt + 1) * 128][:n - qt * 128].all()


@pytest.mark.parametrize("doc", [_loader_docs(2, 300), torch.randint(0, 3, (2, 300)),
                                 torch.zeros(2, 300, dtype=torch.long)], ids=["loader", "unsorted", "one_doc"])
def test_flex_forward_and_gradient_equal_the_dense_mask(doc, flex_backward_on_cpu):
    q, k, v = _qkv(grad=True)
    out = da._flex_doc_attention(q, k, v, doc)
    ref = _dense(q, k, v, doc)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_compiled_flex_kernel_uses_the_block_tables_correctly():
    # The compiled kernel (unlike the reference) skips tiles, so a wrong table would show here.
    q, k, v = _qkv(dtype=torch.float32, n=260)
    compiled = torch.compile(da._flex_doc_attention, fullgraph=True)
    for seed in (0, 1):  # new document ids, no recompilation needed
        doc = _loader_docs(2, 260, seed=seed)
        torch.testing.assert_close(compiled(q, k, v, doc), _dense(q, k, v, doc), rtol=1e-5, atol=1e-5)


def test_backend_resolution():
    assert da.resolve_doc_mask_backend("auto", "cpu", 64) == da.resolve_doc_mask_backend("auto", "cuda", 64) == "sdpa"
    assert da.resolve_doc_mask_backend("flex", "cpu", 8) == da.resolve_doc_mask_backend("flex", "cuda", 16) == "flex"
    assert da.resolve_doc_mask_backend("sdpa", "cuda", 64) == "sdpa"
    with pytest.raises(ValueError, match="at least 16 dimensions, this model's have 8: use 'auto' or 'sdpa'"):
        da.resolve_doc_mask_backend("flex", "cuda", 8)
    with pytest.raises(ValueError, match=r"HydraConfig.doc_mask_backend='dense': must be one of"):
        tiny_model(doc_mask_backend="dense")


@pytest.mark.parametrize("overrides", [{}, {"arch": "dense", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}],
                         ids=["hydra", "dense"])
def test_model_gives_the_same_loss_and_gradients_with_flex(overrides, flex_backward_on_cpu, monkeypatch):
    # Routed units attend over compacted rows with their own doc ids: flex must see those.
    calls = []
    flex = da._flex_doc_attention
    monkeypatch.setattr(da, "_flex_doc_attention", lambda q, k, v, doc: calls.append(doc.shape) or flex(q, k, v, doc))
    ids = torch.randint(0, TINY["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(4))
    doc = torch.tensor([[0] * 13 + [1] * 20 + [2] * 15, [0] * 40 + [1] * 8])
    # Two models of the same weights in one process, each with the backend of its own config.
    models = {b: tiny_model(doc_mask_backend=b, **overrides).double().train() for b in ("sdpa", "flex")}
    results = []
    for backend, model in models.items():
        seen = len(calls)
        loss = model(ids, targets=torch.roll(ids, -1, 1), doc_ids=doc)["loss"]
        loss.backward()
        assert (len(calls) > seen) == (backend == "flex")
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert calls and (overrides or min(n for _, n in calls) < 48), "flex ran, on compacted rows when routed"
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-12)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=0, atol=1e-10, msg=name)


def test_units_compiled_at_dynamic_token_counts_take_the_dense_mask_with_flex(monkeypatch):
    """Evaluation's compiled units (dynamic token counts, where torch 2.11 failed to lower flex on CUDA) get the
    dense mask of their entries' documents from a flex model: the sdpa model's logits, and no flex call."""
    from hydra_lm.model.block import run_unit

    calls, masks = [], []
    flex = da._flex_doc_attention
    monkeypatch.setattr(da, "_flex_doc_attention", lambda q, k, v, doc: calls.append(1) or flex(q, k, v, doc))

    def unit(layers, xc, rec, pos, rope, caches, valid, doc, weight):  # stands in for the compiled run_unit
        masks.append(doc is not None and doc.mask is not None)
        return run_unit(layers, xc, rec, pos, rope, caches, valid, doc, weight)

    ids = torch.randint(0, TINY["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(5))
    doc = torch.tensor([[0] * 13 + [1] * 20 + [2] * 15, [0] * 40 + [1] * 8])
    models = {b: tiny_model(doc_mask_backend=b).double().eval() for b in ("sdpa", "flex")}
    for block in models["flex"].blocks:
        block.compiled_unit = unit
    with torch.no_grad():
        for mode in ("causal", "topk"):
            want = models["sdpa"](ids, doc_ids=doc, routing=mode)["logits"]
            torch.testing.assert_close(models["flex"](ids, doc_ids=doc, routing=mode)["logits"], want)
    assert masks and all(masks) and not calls


def test_flex_gets_the_autocast_dtype_like_sdpa(monkeypatch):
    seen = []
    flex = da._flex_doc_attention
    monkeypatch.setattr(da, "_flex_doc_attention", lambda q, k, v, doc: seen.append({q.dtype, k.dtype, v.dtype})
                        or flex(q, k, v, doc))
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = tiny_model(doc_mask_backend="sdpa").eval()(ids, doc_ids=doc)["logits"].float()
        out = tiny_model(doc_mask_backend="flex").eval()(ids, doc_ids=doc)["logits"].float()
    assert seen and all(s == {torch.bfloat16} for s in seen)
    torch.testing.assert_close(out, ref, rtol=0, atol=3e-2)


@pytest.mark.parametrize("overrides", [{"arch": "dense", "n_layers": 3, "n_heads": 4, "n_kv_heads": 2},
                                       {"mod_every": 2, "recursions": 1, "n_blocks": 4}], ids=["dense", "mod_only"])
def test_the_dense_mask_is_built_once_per_set_of_entries(overrides, monkeypatch):
    # Every attention over the whole row reads the one mask built by the forward; a routed unit's compacted
    # entries get one mask of their own, built from their gathered documents.
    built, used = [], []
    dense_doc_mask, sdpa = da.dense_doc_mask, F.scaled_dot_product_attention
    monkeypatch.setattr(da, "dense_doc_mask", lambda doc: built.append(doc.clone()) or dense_doc_mask(doc))
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, **kw: used.append(attn_mask) or sdpa(*a, attn_mask=attn_mask, **kw))
    ids = torch.randint(0, TINY["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(4))
    doc = torch.tensor([[0] * 13 + [1] * 20 + [2] * 15, [0] * 40 + [1] * 8])
    tiny_model(**overrides).train()(ids, targets=torch.roll(ids, -1, 1), doc_ids=doc)
    masks = {id(m): m for m in used}
    assert all(m is not None for m in used) and len(masks) == len(built)
    full = [m for m in masks.values() if m.shape[-1] == 48]
    assert len(full) == 1 and sum(m is full[0] for m in used) == (3 if overrides.get("arch") == "dense" else 2)
    assert torch.equal(built[0], doc)
    for m, d in zip(masks.values(), built):  # each mask allows what dense_doc_mask of its entries allows
        torch.testing.assert_close(m == 0, dense_doc_mask(d), rtol=0, atol=0)
        assert m.dtype == torch.float32 and torch.isneginf(m[m != 0]).all()


@pytest.mark.parametrize("kind", ["ccgqa", "gqa"])
def test_a_cached_forward_takes_no_documents(kind):
    # A cache holds one sequence: CCGQA's conv / value-shift state would not follow the documents, and the cached
    # attention would attend across them.
    attn = CCGQAttention(64, 2, 1, 32) if kind == "ccgqa" else GQAttention(64, 2, 1, 32)
    x, pos = torch.randn(1, 4, 64), torch.arange(4)[None]
    cache = attn.new_cache(1, 16, "cpu", torch.float32)
    doc = da.documents(torch.tensor([[0, 0, 1, 1]]), torch.float32)
    with pytest.raises(ValueError, match="takes no documents"):
        attn(x, pos, RotaryEmbedding(32, 16), cache, None, doc)
    assert not cache.slot_valid.any()


def test_rows_laid_end_to_end_never_share_a_document_whatever_the_ids_dtype():
    """The offsets grow with the rows times the ids' range: computed in the ids' own int32 they wrapped for large
    ids and let two rows share a document (flex, and a top-k over the batch, would attend across rows). A model
    refuses dtypes other than int32 and int64, with the fix."""
    ids = torch.tensor([[0, 0, 2_000_000_000], [0, 1, 1], [5, 5, 5]], dtype=torch.int32)
    flat = da.documents_end_to_end(ids).reshape(3, 3)
    assert all(set(flat[i].tolist()).isdisjoint(flat[j].tolist()) for i in range(3) for j in range(i))
    model = tiny_model()
    tokens = torch.randint(0, model.config.vocab_size, (2, 8))
    with pytest.raises(ValueError, match=r"doc_ids must be int32 or int64, got torch.uint8: pass doc_ids.long\(\)"):
        model(tokens, doc_ids=torch.zeros(2, 8, dtype=torch.uint8))

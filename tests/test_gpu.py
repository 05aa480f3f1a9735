"""GPU checks (on a CUDA host: `python -m pytest -q -m gpu` runs every gpu-marked test); skipped elsewhere."""

import pytest
import torch

import hydra_lm
from hydra_lm.train.compile_policy import compile_units
from support import TINY, compiled_graphs, tiny_model

pytestmark = pytest.mark.gpu


def _ids(b, t, vocab, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("overrides", [{}, {"moe": True, "moe_num_layers": 1}, {"arch": "dense", "n_layers": 4}])
def test_bf16_compiled_training_step_matches_eager_and_does_not_recompile(overrides):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = hydra_lm.create_model("debug", vocab_size=1024, max_seq_len=512, **overrides).cuda().train()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for seed in range(3):
        ids = _ids(4, 256, 1024, seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(ids, targets=torch.roll(ids, -1, 1))
            ref = model(ids, targets=torch.roll(ids, -1, 1))
        assert torch.isfinite(out["loss"])
        assert abs(out["loss"].item() - ref["loss"].item()) < 2e-2
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert counter.frame_count == 1


@pytest.mark.parametrize("scope", ["eager", "units"])
def test_whole_step_cuda_graph_matches_ungraphed_steps(scope):
    """GraphedStep: forward, backward (top-k routing, chunked loss) and the fused AdamW update of
    one step replayed as one CUDA graph, eager or with compiled units; losses and the parameters
    after five steps on changing data equal an ungraphed twin's (same compilation), so every
    replay ran the whole update on the new data."""
    from hydra_lm.model.cuda_graphs import GraphedStep

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = hydra_lm.create_model("debug", vocab_size=1024, max_seq_len=512).cuda().train()
    twin = hydra_lm.create_model("debug", vocab_size=1024, max_seq_len=512).cuda().train()
    twin.load_state_dict(model.state_dict())
    model.ce_impl = twin.ce_impl = "chunked"
    if scope == "units":
        compile_units(model)
        compile_units(twin)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True) for m in (model, twin)]
    ids = torch.zeros(4, 256, dtype=torch.long, device="cuda")

    def make_step(m, opt):
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = m(ids, targets=torch.roll(ids, -1, 1))["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step

    start = [p.detach().clone() for p in model.parameters()]
    graphed, eager = GraphedStep(make_step(model, opts[0]), warmup=2), make_step(twin, opts[1])
    for seed in range(5):
        ids.copy_(_ids(4, 256, 1024, seed))
        got, want = graphed().item(), eager().item()
        assert abs(got - want) < 1e-3, (seed, got, want)
    assert graphed.captured
    moved = sum((p - p0).abs().sum() for p, p0 in zip(model.parameters(), start))
    apart = sum((p - q).abs().sum() for p, q in zip(model.parameters(), twin.parameters()))
    assert moved > 0 and apart < 0.01 * moved, (float(apart), float(moved))


def test_decode_matches_forward_on_gpu():
    model = tiny_model().double().cuda().eval()
    ids = _ids(3, 30, TINY["vocab_size"])
    full = model(ids)["logits"]
    caches = model.init_cache(3, 30)
    for t in range(30):
        logits = model.forward_cached(ids[:, t:t + 1], t, caches)
        torch.testing.assert_close(logits, full[:, t], rtol=0, atol=1e-9)


@pytest.mark.parametrize("overrides", [{}, {"moe": True, "moe_num_layers": 1}, {"mor_routing": "token"},
                                       {"arch": "dense", "n_layers": 2}], ids=["hydra", "moe", "token_choice", "dense"])
def test_graph_captured_decoding_matches_eager_decoding(overrides):
    """generate(): the one-token steps replayed as a CUDA graph give the eager loop's tokens (greedy, in
    float64 so no tie flips) and, sampled with the same generator, its samples."""
    moe = overrides.get("moe", False)  # bf16: the grouped GEMM (the fp64 expert loop reads the host)
    model = tiny_model(**overrides).to(torch.bfloat16 if moe else torch.float64).cuda().eval()
    prompt = _ids(3, 7, TINY["vocab_size"])
    # The graph alone (compile_step off on both sides: bf16 fusions could flip a greedy tie); the compiled
    # step is checked in test_compiled_decode_step_matches_the_eager_step.
    graphed = model.generate(prompt, max_new_tokens=20, cuda_graph=True, compile_step=False)
    eager = model.generate(prompt, max_new_tokens=20, cuda_graph=False, compile_step=False)
    assert torch.equal(graphed, eager)
    if not moe:  # and both equal repeated full forwards
        tokens = prompt
        for _ in range(20):
            tokens = torch.cat((tokens, model(tokens)["logits"][:, -1].argmax(-1)[:, None]), dim=1)
        assert torch.equal(graphed, tokens)
    else:  # fp64 MoE decoding falls back to eager on its own and refuses an explicit graph
        fp64 = tiny_model(**overrides).double().cuda().eval()
        assert torch.equal(fp64.generate(prompt, 5), fp64.generate(prompt, 5, cuda_graph=False, compile_step=False))
        with pytest.raises(ValueError, match="with MoE, bf16"):
            fp64.generate(prompt, 5, cuda_graph=True)
    sampled = [model.generate(prompt, 20, temperature=1.0, top_k=20, cuda_graph=graph, compile_step=False,
                              generator=torch.Generator("cuda").manual_seed(1)) for graph in (True, False)]
    assert torch.equal(sampled[0], sampled[1])


def test_compiled_decode_step_matches_the_eager_step():
    """generate() on CUDA (by default the routed units and the routers' selections compiled, the step
    captured): in float64 the eager loop's greedy tokens, one graph for all units and one per router
    signature, without breaks or recompiles after the first step; in bf16 (the 100M preset's layout,
    shrunk) one graph for its 32 units, none for its 28 routers (their decisions run the Triton route
    kernel), and the eager step's logits within bf16 tolerance, teacher-forced so that a flipped tie cannot
    diverge."""
    from hydra_lm.model.block import run_cached_unit
    from hydra_lm.model.decode_step import DecodeStep
    from hydra_lm.model.decode_step import decide_entries

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_model().double().cuda().eval()
    prompt = _ids(3, 7, TINY["vocab_size"])
    eager = model.generate(prompt, max_new_tokens=20, cuda_graph=False, compile_step=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=20), eager)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(prompt, max_new_tokens=25)[:, :27], eager)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"] and compiled_graphs(run_cached_unit) == 1
    assert compiled_graphs(decide_entries) == 0  # expert-choice decisions: kernels/route_decode.py on CUDA

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    big = hydra_lm.create_model("100M", vocab_size=1024, dim=256, n_heads=2, n_kv_heads=1,
                                max_seq_len=256).cuda().eval()
    ids = _ids(4, 40, 1024)
    steps = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for compiled in (False, True):
            caches = big.init_cache(4, 64)
            big.forward_cached(ids[:, :8], 0, caches)
            step = DecodeStep(big, caches, 4, ids.device, graphed=True, compiled=compiled)
            logits = [step(ids[:, 8:9], 8).float().clone()]  # compiles (and captures on the next call)
            with torch._dynamo.config.patch(error_on_recompile=True):
                logits += [step(ids[:, t:t + 1], t).float().clone() for t in range(9, 40)]
            steps.append(logits)
    assert compiled_graphs(run_cached_unit) == 1 and compiled_graphs(decide_entries) == 0
    for t, (want, got) in enumerate(zip(*steps)):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05, msg=f"position {8 + t}")


def test_compiled_prefill_matches_the_eager_prefill_on_gpu():
    """forward_cached(compiled=True) (generate's prefill when its step compiles): the 100M layout, shrunk, in
    fp32 (bf16 fusions could flip a routing decision, and a prefill cannot be teacher-forced): the eager
    prefill's logits and K caches, and a second prompt length without recompiling."""
    from hydra_lm.model.block import run_prefill_block

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    big = hydra_lm.create_model("100M", vocab_size=1024, dim=256, n_heads=2, n_kv_heads=1,
                                max_seq_len=256).cuda().eval()
    with torch.no_grad():
        for i, t in enumerate((40, 57)):
            ids = _ids(4, t, 1024, seed=i)
            eager_caches, caches = big.init_cache(4, 64), big.init_cache(4, 64)
            want = big.forward_cached(ids, 0, eager_caches)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = big.forward_cached(ids, 0, caches, compiled=True)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            for block, eager_block in zip(caches, eager_caches):
                for depth, eager_depth in zip(block, eager_block):
                    valid = eager_depth[0].slot_valid
                    assert torch.equal(depth[0].slot_valid, valid)
                    mask = valid[:, None, :, None]  # the compiled prefill also writes slots marked invalid
                    torch.testing.assert_close(torch.where(mask, depth[0].k, 0), torch.where(mask, eager_depth[0].k, 0),
                                               rtol=1e-3, atol=1e-3)
    assert compiled_graphs(run_prefill_block) == 2  # the two block layouts: MoD-routed or not
    assert not torch._dynamo.utils.counters["graph_break"]


def test_generate_replays_a_prefill_graph_per_bucket_and_reuses_its_session():
    """generate() on CUDA (graphed, compiled) keeps one session per (batch, cache length) and replays the prompt's
    prefill as one CUDA graph per length bucket, the padded entries masked: in float64 every call's greedy tokens
    are the eager loop's; a bucket's first prompt is launched padded, its second captures the graph without
    recompiling, and later prompts of the bucket replay it; another bucket captures one more graph in the same
    session. Without a compiled step the eager prefill is captured alike. The 100M layout, shrunk, in fp32: the replayed
    padded prefill gives the launched prefill's logits, call after call."""
    from hydra_lm.model.decode_session import DecodeSession

    torch._dynamo.reset()
    model = tiny_model().double().cuda().eval()
    for i, t in enumerate((7, 12, 7, 20)):
        prompt = _ids(3, t, TINY["vocab_size"], seed=i)
        eager = model.generate(prompt, max_new_tokens=20, cuda_graph=False, compile_step=False)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            assert torch.equal(model.generate(prompt, max_new_tokens=20), eager)
        # The step and the prefill replayed without compiling: the eager kernels captured at the second call (no
        # host sync: the prefill runs every unit on all its candidates while a stream captures).
        for _ in range(2):
            assert torch.equal(model.generate(prompt, max_new_tokens=20, compile_step=False), eager)
    assert any(s._graphs for s in model._decode_sessions.values() if s._graph_prefill and not s.compiled)
    # The compiled session: bucket 16 captured at its second prompt; bucket 32 seen once, launched, then captured.
    graphed = [s for s in model._decode_sessions.values() if s.bucket(7) is not None and s.compiled]
    assert len(graphed) == 1 and sorted(graphed[0]._graphs) == [16] and graphed[0]._seen == {16, 32}
    prompt = _ids(3, 17, TINY["vocab_size"], seed=4)
    eager = model.generate(prompt, max_new_tokens=20, cuda_graph=False, compile_step=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(prompt, max_new_tokens=20), eager)
    assert sorted(graphed[0]._graphs) == [16, 32]

    torch._dynamo.reset()
    torch.manual_seed(0)
    big = hydra_lm.create_model("100M", vocab_size=1024, dim=256, n_heads=2, n_kv_heads=1,
                                max_seq_len=256).cuda().eval()
    with torch.no_grad():
        session = DecodeSession(big, 4, 64, torch.device("cuda"), graphed=True, compiled=True)
        for i, t in enumerate((40, 57, 40)):
            ids = _ids(4, t, 1024, seed=i)
            got = session.prefill(ids).clone()
            want = big.forward_cached(ids, 0, big.init_cache(4, 64), compiled=True)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        assert sorted(session._graphs) == [64]


def test_prompts_of_several_lengths_generate_on_gpu_as_each_alone():
    """Prompts of different lengths as one batch on CUDA (graphed and compiled: the prefill bucket's graph holding
    each row's prompt length, the step's graphs each row's position): in float64 each row gets the tokens its prompt
    alone gets, at the first call (launched) and the second and third (the bucket's graph captured, then replayed)."""
    torch._dynamo.reset()
    model = tiny_model().double().cuda().eval()
    prompts = [_ids(1, t, TINY["vocab_size"], seed=t)[0] for t in (13, 5, 9)]
    alone = [model.generate(p[None], max_new_tokens=12, cuda_graph=False, compile_step=False)[0] for p in prompts]
    for _ in range(3):
        got = model.generate(prompts, max_new_tokens=12)
        assert all(torch.equal(a, b) for a, b in zip(got, alone))
    assert any(s._graphs for s in model._decode_sessions.values() if s.compiled)


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_step_deciding_on_the_device_matches_the_read_backs(batch):
    """CUDA graph IF nodes (graph_conditionals): the composed step reads nothing back, runs the same units
    and gives the read-back step's logits, float64 so that no decision sits on a rounding tie."""
    from hydra_lm.model import graph_conditionals
    from hydra_lm.model.decode_step import DecodeStep

    reason = graph_conditionals.unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    model = hydra_lm.create_model("100M", vocab_size=1024, dim=256, n_heads=2, n_kv_heads=1,
                                  max_seq_len=256).double().cuda().eval()
    ids = _ids(batch, 48, 1024)
    runs = []
    with torch.no_grad():
        for device_decisions in (False, True):
            caches = model.init_cache(batch, 64)
            model.forward_cached(ids[:, :8], 0, caches)
            step = DecodeStep(model, caches, batch, ids.device, graphed=True, compiled=False,
                              device_decisions=device_decisions)
            logits = [step(ids[:, t:t + 1], t).clone() for t in range(8, 48)]
            runs.append((logits, step.unit_calls, step.readbacks))
    (want, units, reads), (got, device_units, device_reads) = runs
    assert device_reads == 0 < reads
    assert device_units == units < 40 * sum(block.recursions for block in model.blocks)
    for t, (a, b) in enumerate(zip(want, got)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9, msg=f"position {8 + t}")


def test_optimized_training_setup_compiles_graphs_and_matches_eager():
    """create_optimized_training_setup on CUDA: the trainer's plan (compiled units, whole-step CUDA graphs,
    fused loss, TF32) and losses within bf16 tolerance of the same setup run eagerly."""
    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = False
    setups = []
    for fast in (True, False):
        torch.manual_seed(0)
        model = hydra_lm.create_model("debug", vocab_size=1024, max_seq_len=512)
        speed = {} if fast else dict(compile=False, cuda_graph=False, chunked_ce=False)
        setups.append(hydra_lm.create_optimized_training_setup(model, lr=1e-3, device="cuda", **speed))
    fast, eager = setups
    assert (fast.optimized.plan.compile, fast.optimized.plan.cuda_graph) == ("units", True)
    assert fast.optimized.capabilities.cuda_graphs and torch.backends.cuda.matmul.allow_tf32
    assert "routed units" in fast.description and "CUDA graphs" in fast.description, fast.description
    assert eager.optimized.plan.compile is None and "eager" in eager.description
    for seed in range(6):
        ids = _ids(4, 256, 1024, seed)
        batch = {"input_ids": ids, "targets": torch.roll(ids, -1, 1)}
        got, want = fast.step(batch)["loss"].item(), eager.step(batch)["loss"].item()
        assert abs(got - want) < 2e-2, (seed, got, want)
    assert fast.train_step.graphs.captured
    opt = hydra_lm.optimize_for_gpu(hydra_lm.create_model("debug", vocab_size=1024))
    assert opt.module is opt.model and opt.plan.compile == "units" and "decoding" in opt.description


def test_grouped_gemm_moe_matches_the_expert_loop():
    from hydra_lm.model import moe as moe_mod

    torch.manual_seed(0)
    x = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([70, 0, 130, 100], device="cuda")
    offsets = counts.cumsum(0)
    fast = moe_mod.expert_matmul(x, w, offsets)
    ref = torch.cat([x[:70] @ w[0], x[70:200] @ w[2], x[200:] @ w[3]])
    assert (fast.float() - ref.float()).norm() / ref.float().norm() < 1e-2


def test_causal_mode_is_causal_on_gpu():
    model = tiny_model().double().cuda().eval()
    ids = _ids(2, 40, TINY["vocab_size"])
    base = model(ids)["logits"]
    changed = ids.clone()
    changed[:, 20] = (changed[:, 20] + 1) % TINY["vocab_size"]
    torch.testing.assert_close(model(changed)["logits"][:, :20], base[:, :20], rtol=0, atol=1e-10)


def test_flex_document_attention_matches_the_dense_mask_on_gpu():
    """The fused kernel over the rows laid end to end (the [B, N] form gave errors of order 1 on torch 2.11)."""
    from hydra_lm.diagnostics.bench import random_doc_ids
    from hydra_lm.model import doc_attention as da

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, h, 1000, 64, device="cuda", generator=g, requires_grad=True) for h in (8, 2, 2))
    doc = random_doc_ids(4, 1000, mean_len=200, device="cuda")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=da.dense_doc_mask(doc), enable_gqa=True)
    out = torch.compile(da._flex_doc_attention, fullgraph=True)(q, k, v, doc)  # fused kernel, block tables
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("n, autocast, fused", [(1000, True, True), (252, True, False), (1000, False, False)])
def test_cudnns_causal_op_with_the_document_bias_matches_sdpas_mask_on_gpu(n, autocast, fused):
    """The dense mask's CUDA path (cuDNN with the causal flag and the mask as a bias, grouped heads passed as they
    are; SDPA where cuDNN cannot serve the call: a row length off its stride, fp32) against SDPA with the
    boolean mask, eager and compiled."""
    from hydra_lm.diagnostics.bench import random_doc_ids
    from hydra_lm.model import doc_attention as da
    from hydra_lm.model.attention_backend import sdpa_kernel_only

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the path is taken on Hopper or later")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(3, h, n, 32, device="cuda", generator=g, requires_grad=True) for h in (6, 2, 2))
    ids = random_doc_ids(3, n, mean_len=120, device="cuda")
    grad = torch.randn(3, 6, n, 32, device="cuda", generator=g)
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        doc = da.documents_for(ids, "auto", 32, torch.float32)
        assert da._cudnn_skips_the_future(q, doc.mask) == fused
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=da.dense_doc_mask(ids),
                                                               enable_gqa=True)
        outs = [da.doc_causal_attention(q, k, v, doc),
                torch.compile(da.doc_causal_attention, fullgraph=True)(q, k, v, doc)]
    with torch.no_grad():
        assert not da._cudnn_skips_the_future(q, doc.mask)  # evaluation: SDPA (one unit graph for every count)
    with sdpa_kernel_only("math"):  # another SDPA kernel forced (bench --sdpa_kernel): SDPA
        assert not da._cudnn_skips_the_future(q, doc.mask)
    ref_grads = torch.autograd.grad(ref.float(), (q, k, v), grad)
    tol = 3e-2 if autocast else 1e-4
    for out in outs:
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        for a, b in zip(torch.autograd.grad(out.float(), (q, k, v), grad), ref_grads):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_a_model_with_flex_document_masks_gives_the_dense_masks_loss_and_gradients_on_gpu():
    """Eager (flex compiled on its own) and with compiled units (flex traced inside them), routed units
    attending over compacted rows: the dense-mask model's loss and gradients."""
    from hydra_lm.diagnostics.bench import random_doc_ids

    ids = _ids(4, 256, 1024)
    doc = random_doc_ids(4, 256, mean_len=60, device="cuda")
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        models = {b: hydra_lm.create_model("debug", vocab_size=1024, max_seq_len=512, doc_mask_backend=b).cuda().train()
                  for b in ("sdpa", "flex")}
        models["flex"].load_state_dict(models["sdpa"].state_dict())
        out = {}
        for backend, model in models.items():
            if compiled:
                compile_units(model)
            loss = model(ids, targets=torch.roll(ids, -1, 1), doc_ids=doc)["loss"]
            loss.backward()
            out[backend] = (loss.detach(), [p.grad for p in model.parameters() if p.grad is not None])
        torch.testing.assert_close(out["flex"][0], out["sdpa"][0], rtol=1e-4, atol=1e-4)
        for a, b in zip(out["flex"][1], out["sdpa"][1]):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_a_cuda_graph_replay_rebuilds_the_flex_block_mask_from_the_new_documents():
    """The block mask is computed on the GPU from the doc ids inside the graph, so a replay after new ids
    are copied into the captured buffer attends within the new documents: the dense mask's logits."""
    from hydra_lm.diagnostics.bench import random_doc_ids

    torch.manual_seed(0)
    models = {b: hydra_lm.create_model("debug", vocab_size=1024, max_seq_len=512, doc_mask_backend=b).cuda().train()
              for b in ("sdpa", "flex")}  # training mode: top-k routing, the fixed shapes a graph needs
    models["flex"].load_state_dict(models["sdpa"].state_dict())
    ids = _ids(4, 256, 1024)
    doc = random_doc_ids(4, 256, mean_len=60, seed=0, device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                models["flex"](ids, doc_ids=doc)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = models["flex"](ids, doc_ids=doc)["logits"]
        for seed in (1, 2, 3):
            new = random_doc_ids(4, 256, mean_len=20 * seed, seed=seed, device="cuda")
            doc.copy_(new)
            graph.replay()
            want = models["sdpa"](ids, doc_ids=new)["logits"]
            torch.testing.assert_close(logits, want, rtol=1e-3, atol=1e-3, msg=f"documents of seed {seed}")
            assert not torch.allclose(want, models["sdpa"](ids)["logits"], atol=1e-2)  # the documents matter


def test_a_missing_attention_package_is_named_on_the_first_cuda_forward():
    from hydra_lm.model.attention_backend import FLASH_ATTN_AVAILABLE

    if FLASH_ATTN_AVAILABLE:
        pytest.skip("flash-attn is installed")
    model = hydra_lm.create_model("debug", vocab_size=1024, max_seq_len=512, attention_backend="flash").cuda()
    with pytest.raises(ValueError, match="pip install flash-attn.*--model.attention_backend auto"):
        model(_ids(2, 64, 1024))


def test_bench_defaults_run_the_fast_path(tmp_path):
    """`hydra-lm bench` without speed flags on CUDA: compiled units, whole-step CUDA graphs, the chunked
    loss and document masks; decoding timed at every default batch size with graph-captured steps."""
    import json

    from hydra_lm.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--model_size", "debug", "--arch", "both", "--vocab_size", "1024", "--batch_size", "2",
                 "--seq_len", "256", "--steps", "3", "--warmup", "1", "--inference", "--new_tokens", "16",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["compile"], report["cuda_graph"]) == ("units", True)
    for row in report["rows"]:
        assert row["ce_impl"] == "chunked" and row["tokens_per_s"] > 0 and row["decode_cuda_graph"]
        assert row["decode_compiled"]  # on CUDA the decode step's units compile by default
        assert row["doc_mask_path"] == "dense-mask"  # documents masked, as the trainer does
        rates = [row[f"decode_tokens_per_s_batch{b}"] for b in (1, 8, 32, 128)]
        # a steady decode step of this model takes well over 10 microseconds: no division by ~0
        assert all(0 < r < b / 1e-5 for r, b in zip(rates, (1, 8, 32, 128))), rates


def test_the_peak_flops_probe_leaves_the_random_streams_alone():
    """The trainer measures the MFU denominator after a resume restored the RNGs: draws must go on as uninterrupted."""
    from hydra_lm.train.metrics import measure_peak_flops

    device = torch.device("cuda")
    before = torch.cuda.get_rng_state(device)
    assert measure_peak_flops(device) > 0
    assert torch.equal(torch.cuda.get_rng_state(device), before)


@pytest.mark.parametrize("backend,package", [("flash", "flash_attn"), ("xformers", "xformers")])
def test_attention_packages_give_sdpas_causal_grouped_attention(backend, package):
    """Each optional package's path (its layout, its causal mask, the grouped heads' pairing) against SDPA. Runs only
    where the package is installed: the device image has neither (sixty-fifth session), so this is still unrun."""
    pytest.importorskip(package)
    from hydra_lm.model.attention_backend import flexible_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                            is_causal=True)
    got = flexible_attention(q, k, v, backend)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    non_causal = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                                                  v.repeat_interleave(4, 1))
    assert (got.float() - non_causal.float()).abs().max() > 0.1

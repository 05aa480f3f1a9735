"""What ``generate`` keeps between calls (``hydra_lm.model.decode_session``): the caches and the one-token step of a
(batch, cache length, settings), reused while the weights stay as they were. A reused session must decode exactly
as a fresh one would, whatever the previous call left in it; a session built from other weights must never be
reused. (The prefill graph per prompt-length bucket needs CUDA: tests/test_gpu.py.) Only a graphed or compiled
session is kept; the tests of reuse run the compiled step's sessions on the CPU with its functions left uncompiled
(``compiled_sessions``): the keeping and reuse are the compiled path's own, the arithmetic eager's."""

import copy

import pytest
import torch

from hydra_lm.model import decode_session, decode_step
from hydra_lm.model import hydra as hydra_module

from support import TINY, tiny_model
from test_causal_routing import _calibrate, _drift


def _model(**overrides):
    model = tiny_model(**overrides)
    _drift(model)
    _calibrate(model, batches=5)  # causal routing with calibrated thresholds, as after training
    return model.double().eval()


def _prompt(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


def _full_forward_tokens(model, prompt, n: int) -> torch.Tensor:
    tokens = prompt
    with torch.no_grad():
        for _ in range(n):
            tokens = torch.cat((tokens, model(tokens)["logits"][:, -1].argmax(-1)[:, None]), dim=1)
    return tokens


def _sessions(model) -> list:
    return list(model._decode_sessions.values())


@pytest.fixture
def compiled_sessions(monkeypatch):
    """``generate`` on the compiled step's path (its sessions are kept), its functions run as they are: compiling
    them would test the compiler, not the keeping and reuse."""
    monkeypatch.setattr(hydra_module, "decode_compiles", lambda device, compile_step: True)
    monkeypatch.setattr(decode_step, "_compile_for_decode", lambda fn, device, dynamic=False: fn)


def test_an_eager_step_keeps_no_session_past_its_call(monkeypatch):
    """Neither graphed nor compiled (the CPU's default), a session has no graph to reuse and caches of exactly its
    call's length: calls of several lengths would each keep one (up to SESSIONS_KEPT: 512 MiB for the 100M preset
    at 8 x 1,000 positions), so none outlives its call. A graphed or a compiled one is still kept."""
    model = _model()
    for t in range(4, 4 + decode_session.SESSIONS_KEPT + 1):
        prompt = _prompt(2, t, t)
        assert torch.equal(model.generate(prompt, max_new_tokens=3), _full_forward_tokens(model, prompt, 3))
        assert not model._decode_sessions
    monkeypatch.setattr(decode_session, "DecodeSession", lambda *args: object())  # what is kept, not how it is built
    for graphed, compiled in ((True, False), (False, True)):
        built = model._decode_sessions.get_or_build(model, 2, 16, torch.device("cpu"), graphed, compiled)
        assert _sessions(model)[-1] is built
    assert len(model._decode_sessions) == 2


@pytest.mark.usefixtures("compiled_sessions")
@pytest.mark.parametrize("overrides", [{}, dict(mor_routing="token"), dict(moe=True, moe_num_layers=2)],
                         ids=["hydra", "token_choice", "moe"])
def test_a_reused_session_decodes_each_prompt_as_a_fresh_one(overrides):
    """Three calls of one shape, the third repeating the first's prompt after a different second: one session
    serves all three, and each call's greedy tokens are what repeated full forwards pick."""
    model = _model(**overrides)
    prompts = [_prompt(3, 9, 0), _prompt(3, 9, 1), _prompt(3, 9, 0)]
    outs = [model.generate(p, max_new_tokens=12) for p in prompts]
    assert len(_sessions(model)) == 1
    for prompt, out in zip(prompts, outs):
        assert torch.equal(out, _full_forward_tokens(model, prompt, 12))
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])


def _train_steps(model) -> None:
    """In-place optimizer updates: the parameters keep their storage, their versions move."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)
    for seed in range(5):
        ids = _prompt(2, 16, seed)
        model(ids, targets=torch.roll(ids, -1, 1))["loss"].backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@pytest.mark.usefixtures("compiled_sessions")
@pytest.mark.parametrize("change", ["optimizer_step", "load_state_dict", "curriculum", "device_copy"])
def test_a_session_built_from_other_weights_is_never_reused(change):
    """After an optimizer step, a loaded state dict, a routing curriculum change or a copy of the weights to new
    storage, the next call builds a new session (the old one's cast weights, graphs and op list are stale: on a
    GPU the step holds bf16 copies of the Linear weights and graphs that read the old storage) and decodes with
    the model as it is now; the call after it, nothing changed, reuses the new one."""
    model = _model()
    prompt = _prompt(2, 8, 5)
    model.generate(prompt, max_new_tokens=10)
    old = _sessions(model)[0]
    if change == "optimizer_step":
        _train_steps(model)
    elif change == "load_state_dict":
        other = _model()
        _train_steps(other)
        model.load_state_dict(other.state_dict())
    elif change == "curriculum":
        model.set_curriculum(mod_active=False)
    else:
        model.to(torch.float32).to(torch.float64)
    after = model.generate(prompt, max_new_tokens=10)
    new = _sessions(model)[0]
    assert new is not old and len(_sessions(model)) == 1
    assert torch.equal(after, _full_forward_tokens(model, prompt, 10))
    model.generate(prompt, max_new_tokens=10)  # nothing changed since: reused
    assert _sessions(model) == [new]


@pytest.mark.usefixtures("compiled_sessions")
def test_calls_inside_and_outside_inference_mode_keep_separate_sessions():
    """Caches built under ``torch.inference_mode()`` are inference tensors, which a later call outside it could not
    zero in place: each mode decodes with sessions of its own, and both give the same tokens."""
    model = _model()
    with torch.inference_mode():
        inside = model.generate(_prompt(2, 5, 0), max_new_tokens=3)
    outside = model.generate(_prompt(2, 5, 0), max_new_tokens=3)
    assert torch.equal(inside, outside) and len(model._decode_sessions) == 2


@pytest.mark.usefixtures("compiled_sessions")
def test_a_model_made_under_inference_mode_decodes_with_a_new_session_each_call():
    """Parameters created or loaded under ``torch.inference_mode()`` are inference tensors: they keep no version, so
    an in-place change (a state dict loaded in inference mode) cannot be seen. Such a model decodes, inside inference
    mode and out, with a session built for the call, never a kept one."""
    model = _model()
    with torch.inference_mode():
        twin = copy.deepcopy(model)
    assert all(p.is_inference() for p in twin.parameters())
    prompt = _prompt(2, 5, 0)
    want = model.generate(prompt, max_new_tokens=4)
    with torch.inference_mode():
        inside = twin.generate(prompt, max_new_tokens=4)
        first = _sessions(twin)[0]
        assert torch.equal(twin.generate(prompt, max_new_tokens=4), want) and _sessions(twin)[0] is not first
    assert torch.equal(inside, want) and torch.equal(twin.generate(prompt, max_new_tokens=4), want)


@pytest.mark.usefixtures("compiled_sessions")
def test_sessions_are_bounded_released_and_never_copied(monkeypatch):
    """At most SESSIONS_KEPT sessions, the least recently used dropped first; release_decode_state frees them; a
    deep copy of the model carries none (it decodes with its own); an error inside a call drops its session."""
    model = _model()
    for b in range(1, decode_session.SESSIONS_KEPT + 2):
        model.generate(_prompt(b, 5, b), max_new_tokens=3)
    kept = [key[0] for key in model._decode_sessions]
    assert kept == list(range(2, decode_session.SESSIONS_KEPT + 2))  # batch 1, the oldest, dropped
    model.generate(_prompt(2, 5, 0), max_new_tokens=3)  # batch 2 used again: now the most recent
    assert [key[0] for key in model._decode_sessions][-1] == 2

    twin = copy.deepcopy(model)
    assert len(twin._decode_sessions) == 0
    assert torch.equal(twin.generate(_prompt(2, 5, 0), 3), model.generate(_prompt(2, 5, 0), 3))

    model.release_decode_state()
    assert len(model._decode_sessions) == 0

    def failing(*args, **kwargs):
        raise RuntimeError("interrupted")

    model.generate(_prompt(1, 5, 0), max_new_tokens=3)
    model.generate(_prompt(2, 5, 0), max_new_tokens=3)
    monkeypatch.setattr(hydra_module, "sample_next", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        model.generate(_prompt(2, 5, 0), max_new_tokens=3)
    assert [key[0] for key in model._decode_sessions] == [1]  # the failed call's session dropped, no other


def test_prompt_buckets_are_powers_of_two_within_the_cache_and_the_token_bound():
    """The padded length a graphed prefill replays at: the next power of two (at least MIN_PREFILL_BUCKET), never
    past the cache; none above GRAPHED_PREFILL_TOKENS tokens, nor where the step is not graphed."""
    session = decode_session.DecodeSession.__new__(decode_session.DecodeSession)
    session._graph_prefill, session.batch, session.length = True, 2, 512
    assert [session.bucket(t) for t in (1, 16, 17, 100, 128, 129, 500)] == [16, 16, 32, 128, 128, 256, 512]
    session.batch = decode_session.GRAPHED_PREFILL_TOKENS // 256
    assert session.bucket(256) == 256 and session.bucket(257) is None
    session._graph_prefill = False
    assert session.bucket(16) is None


def test_a_buckets_first_prompt_is_launched_padded_and_prefills_as_the_prompt_alone():
    """A one-off call pays no capture: a graphed session launches its bucket's first prompt, padded to the bucket
    with the padding masked, and remembers the bucket (its second prompt captures the graph, on CUDA:
    tests/test_gpu.py). Its logits are the unpadded prefill's, and so are the steps' after it (the padded slots
    were never stored as valid)."""
    model = _model()
    prompt = _prompt(2, 11, 0)
    session = decode_session.DecodeSession(model, 2, 32, torch.device("cpu"), graphed=False, compiled=False)
    session._graph_prefill = True  # as on CUDA; only a repeated bucket would capture
    with torch.no_grad():
        got = session.prefill(prompt)
        want = model.forward_cached(prompt, 0, caches := model.init_cache(2, 32))
        assert session._seen == {16} and not session._graphs
        torch.testing.assert_close(got, want)
        for position in range(11, 14):
            token = want.argmax(-1)[:, None]
            got, want = session.step(token, position), model.forward_cached(token, position, caches)
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bucketed", [False, True], ids=["launched", "bucketed"])
def test_prompts_of_several_lengths_prefill_and_step_each_as_alone(bucketed):
    """A session's prefill with each row's prompt length (the rest of the row padding), then steps at each row's own
    position: every row's logits are those of its prompt decoded alone, launched as it is or padded to a bucket (as a
    graphed session pads it)."""
    model = _model()
    lengths = torch.tensor([11, 4])
    ids = _prompt(2, 11, 0)
    session = decode_session.DecodeSession(model, 2, 32, torch.device("cpu"), graphed=False, compiled=False)
    session._graph_prefill = bucketed
    with torch.no_grad():
        logits = [session.prefill(ids, lengths).clone()]
        session.step.set_prompt_lengths(lengths)
        tokens = []
        for i in range(4):
            tokens.append(logits[-1].argmax(-1)[:, None])
            logits.append(session.step(tokens[-1], 11 + i).clone())  # the longest prompt's position
        for r, n in enumerate(lengths.tolist()):
            caches = model.init_cache(1, 32)
            want = [model.forward_cached(ids[r:r + 1, :n], 0, caches)]
            want += [model.forward_cached(tokens[i][r:r + 1], n + i, caches) for i in range(4)]
            for got, expected in zip(logits, want):
                torch.testing.assert_close(got[r:r + 1], expected)
    assert session._seen == ({16} if bucketed else set())


def test_a_prompt_of_the_whole_context_still_gets_its_next_token():
    """The last new token is sampled, never fed back: it takes no cache position, so prompt + new tokens may be one
    more than max_seq_len (a prompt filling the context gets the full forward's next token)."""
    model = _model()
    context = model.config.max_seq_len
    prompt = _prompt(2, context, seed=5)
    with torch.no_grad():
        want = model(prompt)["logits"][:, -1].argmax(-1)
        shorter = model(prompt[:, :context - 3])["logits"]
    assert torch.equal(model.generate(prompt, 1)[:, -1], want)
    out = model.generate(prompt[:, :context - 3], 4)  # 3 fed back + 1 sampled: one past the context
    assert out.shape == (2, context + 1) and torch.equal(out[:, context - 3], shorter[:, -1].argmax(-1))
    with pytest.raises(ValueError, match=rf"prompt \({context}\) \+ max_new_tokens \(2\) exceeds"):
        model.generate(prompt, 2)

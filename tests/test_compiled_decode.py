"""The compiled one-token decode step (``generate(compile_step=True)``, opt-in) against the
eager step: the same greedy tokens, one graph without breaks, no recompilation per position."""

import pytest
import torch

from hydra_lm.model import hydra as hydra_module

from support import TINY, tiny_model
from test_causal_routing import _calibrate, _drift


@pytest.fixture
def aot_eager(monkeypatch):
    # Dynamo's trace and AOT's functionalized cache updates, without code generation: inductor's C++
    # backend fails on this graph in some CPU builds (the CUDA path generates Triton; see test_gpu.py).
    monkeypatch.setattr(hydra_module, "DECODE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("overrides", [{}, dict(mor_routing="token")], ids=["hydra", "token_choice"])
def test_compiled_decode_step_gives_the_eager_steps_greedy_tokens(aot_eager, overrides):
    model = tiny_model(**overrides)
    _drift(model)
    _calibrate(model, batches=5)  # causal routing with calibrated thresholds, as after training
    model = model.double().eval()
    prompt = torch.randint(0, TINY["vocab_size"], (3, 7), generator=torch.Generator().manual_seed(0))
    eager = model.generate(prompt, max_new_tokens=20, compile_step=False)
    # A position is a value in a tensor buffer: a recompilation per position (or per call) raises here.
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(prompt, max_new_tokens=20, compile_step=True)
        longer = model.generate(prompt, max_new_tokens=25, compile_step=True)  # same cache bucket: reused
    assert torch.equal(compiled, eager) and torch.equal(longer[:, :27], eager)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])  # a break would hint at a host sync
    assert counters["stats"]["unique_graphs"] == 1
    tokens = prompt  # and both are what repeated full forwards pick
    for _ in range(20):
        tokens = torch.cat((tokens, model(tokens)["logits"][:, -1].argmax(-1)[:, None]), dim=1)
    assert torch.equal(compiled, tokens)


def test_compile_step_is_opt_in(monkeypatch):
    calls = []
    monkeypatch.setattr(hydra_module, "compiled_decode_forward", lambda backend=None: calls.append(backend))
    model = tiny_model().eval()
    model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=3)
    assert calls == []

import pytest
import torch

import hydra_lm

# Small enough for CPU tests, big enough to exercise every path: 3 blocks x 3 recursions, GQA 2:1
# in a latent of dim/4, MoD on every block so that routing changes the compacted sequences.
TINY = dict(vocab_size=97, dim=64, n_blocks=3, recursions=3, n_heads=2, n_kv_heads=1, mlp_hidden=96,
            max_seq_len=128, mod_every=1, mod_capacity=0.5)

VARIANTS = {
    "hydra": {},
    "mod_every_2": dict(mod_every=2, mod_capacity=0.75),
    "layer_aware": dict(mor_capacity_schedule="layer_aware"),
    "token_choice": dict(mor_routing="token"),
    "middle_cycle": dict(sharing="middle_cycle", n_blocks=4),
    "static": dict(static_routing_mode=True),
    "moe": dict(moe=True, moe_num_layers=2, moe_num_experts=3, moe_top_k=1),
    "moe_top2": dict(moe=True, moe_num_layers=1, moe_num_experts=3, moe_top_k=2),
    "no_routing": dict(mod_enabled=False, mor_enabled=False),
    "dense": dict(arch="dense", n_layers=3, n_heads=4, n_kv_heads=2),
}


def tiny_model(seed: int = 0, **overrides) -> hydra_lm.HydraModel:
    torch.manual_seed(seed)
    return hydra_lm.create_model("debug", **{**TINY, **overrides})


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    return request.param, VARIANTS[request.param]

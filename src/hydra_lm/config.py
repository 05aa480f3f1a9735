"""Model configuration: one typed dataclass, one preset table, validation with actionable errors."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("hydra", "dense")
SHARING = ("sequence", "middle_cycle")
MOR_ROUTING = ("expert", "token")
TOPK_OVER = ("row", "batch", "causal")
MOR_SCHEDULES = ("paper", "layer_aware", "geometric")
ATTENTION_BACKENDS = ("auto", "sdpa", "flash", "xformers")
DOC_MASK_BACKENDS = ("auto", "flex", "sdpa")
DECODE_KERNELS = ("auto", "triton", "torch")
# The fields that choose how attention is computed, not what: a run may change them when it resumes.
KERNEL_CHOICES = ("attention_backend", "doc_mask_backend", "decode_kernel")
# Model fields the dense baseline never reads (its layers are GQA, unrouted, each applied once): a dense model given
# one is the model it would be without it.
HYDRA_ONLY_FIELDS = ("recursions", "sharing", "mod_enabled", "mod_capacity", "mod_every", "mod_first_block",
                     "mor_enabled", "mor_routing", "topk_over", "topk_groups", "mor_capacity_schedule", "mor_capacity",
                     "mor_gate_scale", "static_routing_mode", "mod_aux_weight", "mor_aux_weight",
                     "compression_factor", "conv_seq_kernel", "conv_ch_kernel", "qk_mean", "value_shift",
                     "decode_kernel")


@dataclass
class HydraConfig:
    """Everything that defines a HYDRA (or dense baseline) model.

    Attention layout (CCGQA, arXiv 2510.04476): queries live in a latent of width
    ``n_heads * head_dim = dim / compression_factor``; keys/values in ``n_kv_heads * head_dim``.
    """

    arch: str = "hydra"
    vocab_size: int = 50257
    dim: int = 512
    n_blocks: int = 2  # unique recursive blocks (``n_mor_blocks`` in the original HYDRA code)
    recursions: int = 2  # applications of each block's shared weights
    n_layers: int | None = None  # dense arch only; default n_blocks
    n_heads: int = 4  # latent query heads (hydra) / query heads (dense)
    n_kv_heads: int = 2
    head_dim: int | None = None  # default: dim // (compression_factor * n_heads) (hydra), dim // n_heads (dense)
    compression_factor: int = 4  # C1: query down-projection factor
    mlp_hidden: int | None = None  # default: 4 * dim rounded up to a multiple of 256
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02

    # CCGQA details
    conv_seq_kernel: int = 3  # depthwise causal conv over time
    conv_ch_kernel: int = 2  # grouped (one group per head) causal conv over time
    qk_mean: bool = True
    value_shift: bool = True

    # Routing (MoD arXiv 2404.02258, MoR arXiv 2507.10524)
    sharing: str = "sequence"  # "sequence": block b repeated R times; "middle_cycle": first/last unshared
    mod_enabled: bool = True
    mod_capacity: float = 0.125  # fraction of the row that enters a MoD-routed block (best per GPU-second measured)
    mod_every: int = 2  # every mod_every-th block is MoD-routed (1 = every block after the first)
    # MoD-route the first block too (with mod_every=1). Off by default: that block's router sees bare token
    # embeddings, and a token it skips reaches the next router with nothing but its embedding, so routing
    # decides by token id and, through ties and row make-up, causal routing missed top-k by 0.035-0.071 nats
    # at 100M (docs/routing.md, "The first block runs every token"). Configs saved before the field existed with
    # mod_every=1 load with it True (HydraConfig.from_saved), as they were built.
    mod_first_block: bool = False
    mor_enabled: bool = True  # False: fixed depth, every recursion runs every (MoD-selected) token
    mor_routing: str = "expert"  # "expert" (expert-choice, hierarchical) or "token" (token-choice)
    # What training's top-k of an expert-choice router (MoD, expert-choice MoR) ranks: "row" (each row's k
    # highest logits, the MoD paper's) or "batch" (the batch's rows * k highest, one boundary for all rows, so
    # rows' counts vary as the causal rule's do); its units attend over the batch's chosen entries as one row
    # with the rows kept apart as documents. At 100M on one H200 "batch" raised agreement with the causal rule
    # by 0.5-1.9 points (to 95.0-96.7%) with the causal loss lower or higher by setting, at 0.97x the tokens/s
    # with doc_mask_backend "flex" and 0.69x with the dense mask: opt-in (docs/routing.md, "Top-k over the batch").
    # "causal": the batch's rows * k entries with the causal rule's admissions first (filled with the highest other
    # logits or trimmed to the budget), so training runs what decoding will; laid out as "batch" is. At 100M it agreed
    # on 97.4-98.0% of decisions (three seeds of the preset) with the causal loss tied at equal tokens, but at 0.92x
    # the training tokens/s it lost at equal time: opt-in (docs/routing.md).
    topk_over: str = "row"
    # With topk_over "batch" or "causal": how many equal groups the batch's rows are pooled in, each group's chosen
    # entries laid end to end as one row (1: the whole batch). Smaller groups attend over fewer entries (with the
    # dense document mask the cost falls with the group's size) and let counts vary over fewer rows. At 100M on one
    # H200, "causal" over groups of 4 of 16 rows agreed on 96.9-97.2% of decisions (three seeds; the whole batch
    # 97.6%) at 0.97x the default's training tokens/s (the whole batch 0.91x), its causal loss tied at equal tokens.
    topk_groups: int = 1
    # "geometric" (default; best val loss per GPU-second measured at 100M): each depth keeps mor_capacity
    # of the previous depth's tokens; "paper": (R-j)/R of the row at depth j = 0..R-1; "layer_aware": deeper late blocks
    mor_capacity_schedule: str = "geometric"
    mor_capacity: float = 0.125
    mor_gate_scale: float = 0.1  # alpha in gate = alpha * sigmoid(router logit)
    static_routing_mode: bool = False  # soft routing: every token runs every unit, weighted by its gate
    mod_aux_weight: float | None = None  # None: max(0.01, 0.01 * (L/32) * sqrt(dim/768))
    mor_aux_weight: float = 1e-3

    # Optional MoE feed-forward blocks inserted between recursive blocks
    moe: bool = False
    moe_num_experts: int = 4
    moe_num_layers: int = 1
    moe_top_k: int = 1
    moe_hidden: int | None = None  # default: mlp_hidden
    moe_aux_weight: float = 0.01
    moe_router_jitter: float = 0.01

    # Kernels: how attention is computed, not what (model/attention_backend.py, model/doc_attention.py).
    # Per model, so two models in one process may differ.
    attention_backend: str = "auto"  # "auto"/"sdpa": PyTorch SDPA; "flash": flash-attn; "xformers" (CUDA only)
    # document-masked attention: "auto"/"sdpa" a dense SDPA mask; "flex" block-sparse FlexAttention (on CUDA:
    # heads of >= 16 dimensions; model/doc_attention.py)
    doc_mask_backend: str = "auto"
    # A decoded token's CCGQA attention (one new token per row, model/attention.py): "auto" one Triton kernel on
    # CUDA where Triton is installed (kernels/ccgqa_decode.py: a 100M unit's 26 kernels become 10), else PyTorch
    # ops; "triton" the kernel always (on a CPU under TRITON_INTERPRET=1 only); "torch" the PyTorch ops.
    decode_kernel: str = "auto"

    # Filled in by the preset that built this config (informational)
    preset: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_types(self.to_dict(), type(self))
        for name, value in _derived_defaults(self.to_dict()).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def bad(field_name: str, msg: str) -> None:
            raise ValueError(f"HydraConfig.{field_name}={getattr(self, field_name)!r}: {msg}")

        _choice(self, "arch", ARCHS)
        _choice(self, "sharing", SHARING)
        _choice(self, "mor_routing", MOR_ROUTING)
        _choice(self, "topk_over", TOPK_OVER)
        _choice(self, "mor_capacity_schedule", MOR_SCHEDULES)
        _choice(self, "attention_backend", ATTENTION_BACKENDS)
        _choice(self, "doc_mask_backend", DOC_MASK_BACKENDS)
        _choice(self, "decode_kernel", DECODE_KERNELS)
        for name in ("vocab_size", "dim", "n_blocks", "recursions", "n_layers", "n_heads", "n_kv_heads",
                     "compression_factor", "mlp_hidden", "max_seq_len", "conv_seq_kernel", "conv_ch_kernel",
                     "mod_every", "moe_num_experts", "moe_num_layers", "moe_top_k", "moe_hidden", "topk_groups"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be a positive integer")
        # The fields head_dim is derived from come first: a bad one is named, not the head_dim of 0 it gave; and
        # n_heads before n_kv_heads, whose advice would otherwise lead to a head count the width cannot take.
        if self.arch == "hydra" and self.dim % self.compression_factor:
            bad("compression_factor", f"must divide dim={self.dim}; the query latent is dim/compression_factor")
        latent = self.dim // self.compression_factor if self.arch == "hydra" else self.dim
        what = f"the query latent dim/compression_factor={latent}" if self.arch == "hydra" else \
            f"dim={latent} for the dense baseline"
        if latent % self.n_heads:
            heads = [d for d in range(1, latent + 1) if latent % d == 0 and latent // d % 2 == 0]
            bad("n_heads", f"must divide {what} (each head an even share of it): " +
                (f"try one of {heads}" if heads else "no head count can, as the width is odd: make it even"))
        if self.n_heads % self.n_kv_heads:
            bad("n_kv_heads", f"must divide n_heads={self.n_heads} (grouped-query attention); "
                              f"try one of {[d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]}")
        if self.head_dim != latent // self.n_heads:
            bad("head_dim", f"n_heads*head_dim={self.n_heads}*{self.head_dim} must equal {what}: set head_dim="
                            f"{latent // self.n_heads} or leave it unset")
        if self.head_dim % 2:
            bad("head_dim", "must be even (rotary embeddings rotate channel pairs)")
        if not (0.0 < self.mod_capacity <= 1.0):
            bad("mod_capacity", "must lie in (0, 1]: it is the fraction of tokens that enter a routed block")
        if not (0.0 < self.mor_capacity <= 1.0):
            bad("mor_capacity", "must lie in (0, 1]: it is the fraction of a depth's tokens that recurse once "
                                "more (mor_capacity_schedule='geometric')")
        for name in ("mor_gate_scale", "rope_theta", "norm_eps", "init_std"):
            if not (0.0 < getattr(self, name) < math.inf):
                bad(name, "must be a finite number > 0")
        if self.sharing == "middle_cycle" and self.n_blocks < 3:
            bad("n_blocks", "middle_cycle sharing needs n_blocks >= 3 (first and last layers are unshared)")
        if self.arch == "hydra" and self.sharing == "middle_cycle" and self.mod_enabled and self.mod_every != 1:
            bad("mod_every", "middle_cycle sharing has one block MoD can route (the shared middle), so every "
                             "mod_every-th block routes none unless mod_every=1: set mod_every=1, or mod_enabled=False")
        if self.arch == "hydra" and self.mod_enabled and self.mod_capacity < 1 and not self.mod_routes_a_block():
            # Of one block, the first, only mod_first_block routes it; of more, mod_every <= n_blocks routes one.
            fix = "set mod_first_block=True with mod_every=1" if self.n_blocks == 1 else \
                f"lower mod_every to at most {self.n_blocks}"
            bad("mod_every", f"routes none of the {self.n_blocks} block(s) (MoD routes every mod_every-th block, the "
                             f"first only with mod_first_block=True and mod_every=1): {fix}, add blocks, or set "
                             "mod_enabled=False")
        if self.mod_first_block and self.mod_every != 1:
            bad("mod_first_block", f"routes the first block only with mod_every=1 (mod_every={self.mod_every} "
                                   "skips it): set mod_every=1 or mod_first_block=False")
        if self.mod_first_block and self.sharing == "middle_cycle":
            bad("mod_first_block", "middle_cycle's first layer is unshared and never routed (its routed block runs "
                                   "behind it): set mod_first_block=False")
        if self.topk_groups > 1 and self.topk_over == "row":
            bad("topk_groups", "pools rows for a top-k over the batch: set topk_over 'batch' or 'causal', or "
                               "topk_groups=1")
        if self.moe and self.moe_num_experts < 2:
            bad("moe_num_experts", "must be at least 2 with moe=True: over one expert the router's softmax is always "
                                   "1, so it never learns; use 2 or more experts, or moe=False")
        if self.moe_top_k > self.moe_num_experts:
            bad("moe_top_k", f"cannot exceed moe_num_experts={self.moe_num_experts}")
        if self.moe and (self.dim % 8 or self.moe_hidden % 8):
            bad("moe_hidden" if self.dim % 8 == 0 else "dim",
                f"must be a multiple of 8 with moe=True (dim={self.dim}, moe_hidden={self.moe_hidden}): the experts' "
                "grouped GEMM on CUDA needs rows of a multiple of 16 bytes in bf16; round it to a multiple of 8")
        if self.moe and self.moe_num_layers > self.n_units_between_moe():
            bad("moe_num_layers", f"at most {self.n_units_between_moe()} MoE blocks fit between this "
                                  "model's blocks; lower moe_num_layers or add blocks")
        for name in ("mod_aux_weight", "mor_aux_weight", "moe_aux_weight", "moe_router_jitter"):
            value = getattr(self, name)
            if value is not None and not (0 <= value < math.inf):
                bad(name, "must be a finite number >= 0")

    # ------------------------------------------------------------------ derived values
    def mod_routes_a_block(self) -> bool:
        """Whether some block is MoD-routed (``routing.depth_fractions``' rule; middle_cycle's one routable block is
        checked on its own)."""
        if self.sharing == "middle_cycle":
            return self.mod_every == 1
        return any(b % self.mod_every == self.mod_every - 1 and (b > 0 or self.mod_first_block)
                   for b in range(self.n_blocks))

    def n_units_between_moe(self) -> int:
        """How many MoE blocks fit strictly between the model's blocks."""
        if self.arch == "dense":
            return self.n_layers - 1
        return 2 if self.sharing == "middle_cycle" else self.n_blocks - 1

    @property
    def kv_latent(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_latent(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def effective_layers(self) -> int:
        if self.arch == "dense":
            return self.n_layers
        if self.sharing == "middle_cycle":
            return 2 + (self.n_blocks - 2) * self.recursions
        return self.n_blocks * self.recursions

    @property
    def resolved_mod_aux_weight(self) -> float:
        if self.mod_aux_weight is not None:
            return self.mod_aux_weight
        # The original implementation's scaling, floored at its 100M value: below it (fewer effective layers,
        # a narrower model) the router learned its top-k too loosely for the causal rule. At 100M with 1 and
        # 2 recursions and MoD on every block, 0.01 instead of 0.0025 / 0.005 took the causal/top-k gap from
        # +0.040 / +0.010 to -0.006 / -0.001 (benchmarks/BENCHMARKS.md, twentieth session). Ten times the floor
        # raised the 100M causal loss by 0.009-0.090 (fifty-fifth session), so the floor stays where it is.
        return max(0.01, 0.01 * (self.effective_layers / 32) * math.sqrt(self.dim / 768))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "HydraConfig":
        check_keys(values, cls)
        return cls(**values)

    @classmethod
    def from_saved(cls, values: dict[str, Any]) -> "HydraConfig":
        """The config a checkpoint or run directory saved: fields added since default to what the
        model was built with then (MoD on every block routed the first block as well; middle_cycle sharing with
        mod_every > 1, refused since, built no MoD router)."""
        values = dict(values)
        if values.get("mod_every") == 1:
            values.setdefault("mod_first_block", True)
        unrouted_first = values.get("mod_every", 2) != 1 or values.get("sharing") == "middle_cycle"
        if values.get("mod_first_block") and unrouted_first:
            values["mod_first_block"] = False  # what it built: the first block (middle_cycle's first layer) unrouted
        if values.get("sharing") == "middle_cycle" and values.get("mod_every", 2) != 1:
            values["mod_enabled"] = False  # what it built: the shared middle block was not MoD-routed
        as_built = cls.from_dict({**values, "mod_enabled": False})
        if as_built.arch == "hydra" and not as_built.mod_routes_a_block():
            values["mod_enabled"] = False  # what it built: no block was MoD-routed
        return cls.from_dict(values)

    def replace(self, **overrides: Any) -> "HydraConfig":
        """A copy with ``overrides``. The fields derived from others (``head_dim``, ``mlp_hidden``, ``moe_hidden``,
        ``n_layers``) follow them where they held their derived value: ``replace(dim=1024)`` resizes the MLP."""
        check_keys(overrides, type(self))
        return type(self)(**rederived(self.to_dict(), overrides))


def _derived_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """What ``__post_init__`` gives the fields left None, from the other fields of ``values``."""
    get = functools.partial(_field_value, values)
    compressed = get("arch") == "hydra" and get("compression_factor") > 0
    latent = get("dim") // get("compression_factor") if compressed else get("dim")
    mlp_hidden = _round_up(4 * get("dim"), 256)
    return {"n_layers": get("n_blocks"), "head_dim": latent // get("n_heads") if get("n_heads") > 0 else None,
            "mlp_hidden": mlp_hidden, "moe_hidden": values.get("mlp_hidden") or mlp_hidden}


def _field_value(values: dict[str, Any], name: str) -> Any:
    if values.get(name) is not None:
        return values[name]
    return next(f.default for f in dataclasses.fields(HydraConfig) if f.name == name)


def rederived(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a config's fields) with ``overrides``, its derived fields that held their derived value left to
    be derived again from the new values (None)."""
    out = dict(values)
    for name, default in _derived_defaults(values).items():
        if name not in overrides and out.get(name) is not None and out[name] == default:
            out[name] = None
    return {**out, **overrides}


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _choice(cfg: HydraConfig, name: str, options: tuple[str, ...]) -> None:
    if getattr(cfg, name) not in options:
        raise ValueError(f"HydraConfig.{name}={getattr(cfg, name)!r}: must be one of {list(options)}")


def check_keys(values: dict[str, Any], cls: type = HydraConfig) -> None:
    """Reject keys that are not fields of ``cls``, suggesting the closest valid name."""
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(known))}"
            raise ValueError(f"unknown {cls.__name__} key {key!r}{hint}")
    _check_types(values, cls)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "text"}


def _check_types(values: dict[str, Any], cls: type) -> None:
    """A value of the wrong type (``--model.dim abc``) fails here, with its key, not deep in the model."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        allowed = typing.get_args(hints[key]) or (hints[key],)
        if value is None and type(None) in allowed:
            continue
        kind = next(t for t in allowed if t is not type(None))
        ok = isinstance(value, bool) if kind is bool else \
            isinstance(value, int) and not isinstance(value, bool) if kind is int else \
            isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
            isinstance(value, kind)
        if not ok:
            raise ValueError(f"{cls.__name__}.{key}={value!r} must be {_TYPE_NAMES.get(kind, kind.__name__)}")


# One table for every preset. Columns: dim, n_blocks, recursions, n_heads, n_kv_heads (latent heads;
# head_dim = dim / (4 * n_heads) is 32 up to width 768 and 64 above), dense layers for the baseline,
# and the parameter count the original HYDRA release advertised (for reference; README lists the true counts).
PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(dim=512, n_blocks=2, recursions=2, n_heads=4, n_kv_heads=2, advertised_params=33e6),
    "50M": dict(dim=512, n_blocks=8, recursions=3, n_heads=4, n_kv_heads=2, advertised_params=50e6),
    "100M": dict(dim=768, n_blocks=8, recursions=4, n_heads=6, n_kv_heads=2, advertised_params=104e6),
    "250M": dict(dim=1024, n_blocks=10, recursions=4, n_heads=4, n_kv_heads=1, advertised_params=198e6),
    "500M": dict(dim=1280, n_blocks=16, recursions=4, n_heads=5, n_kv_heads=1, advertised_params=426e6),
    "750M": dict(dim=1536, n_blocks=18, recursions=4, n_heads=6, n_kv_heads=2, advertised_params=665e6),
    "1B": dict(dim=1792, n_blocks=20, recursions=4, n_heads=7, n_kv_heads=1, advertised_params=973e6),
    "1.5B": dict(dim=2048, n_blocks=22, recursions=4, n_heads=8, n_kv_heads=2, advertised_params=1369e6),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def _lookup_preset(name: str) -> str:
    for key in PRESETS:
        if key.lower() == str(name).lower():
            return key
    close = difflib.get_close_matches(str(name), list(PRESETS), n=2)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ValueError(f"unknown preset {name!r}{hint}; choose one of {', '.join(PRESETS)}")


def _dense_heads(dim: int) -> tuple[int, int]:
    """The dense baseline's (query heads, key/value heads) at width ``dim``: heads of the even size dividing ``dim``
    nearest 64 (the presets' dim/64), about a quarter as many key/value heads."""
    if not isinstance(dim, int) or dim < 2:
        return 1, 1  # the config's own check names the bad dim
    sizes = [d for d in range(2, dim + 1, 2) if dim % d == 0] or [dim]
    n_heads = dim // min(sizes, key=lambda d: (abs(d - 64), -d))
    return n_heads, max(d for d in range(1, max(1, n_heads // 4) + 1) if n_heads % d == 0)


def preset_config(name: str, **overrides: Any) -> HydraConfig:
    """The config of a named preset, with ``overrides`` applied (unknown keys raise ``ValueError``)."""
    key = _lookup_preset(name)
    check_keys(overrides)
    values = {k: v for k, v in PRESETS[key].items() if k != "advertised_params"}
    if overrides.get("arch") == "dense":
        # The dense baseline keeps width, MLP and depth-in-unique-layers; its attention is full-width GQA.
        values["n_heads"], values["n_kv_heads"] = _dense_heads(overrides.get("dim", values["dim"]))
    values.update(overrides)
    values["preset"] = key
    return HydraConfig(**values)

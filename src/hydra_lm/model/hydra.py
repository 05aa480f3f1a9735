"""Model assembly: embeddings -> routed recursive blocks (+ optional MoE blocks) -> norm -> head.

Routing modes (see ``routing.py``):
* ``model.train()``: expert-choice top-k with fixed k per unit (static shapes);
* ``model.eval()``: causal routing (a token enters a unit iff few enough of the row's earlier candidates
  rank above it, or by the router's calibrated threshold at a row's start, see ``routing.py``) unless
  ``model.eval_routing = "topk"`` (teacher-forced top-k, not an autoregressive number);
* ``static_routing_mode``: every token runs every unit, weighted by its gate.
``generate`` always decodes with causal routing (or static, when configured) and an incremental cache.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from ..config import HydraConfig
from .attention import CCGQAttention, GQAttention
from .decode_session import DecodeSessions
from .decode_step import compiled_prefill, decode_compiles
from .doc_attention import documents_for
from . import head_gradient_overlap
from .block import RecursiveBlock, TransformerLayer
from .loss import linear_cross_entropy, logits_cross_entropy
from .layers import (GradientCheckpointMixin, RMSNorm, RotaryEmbedding, eval_mode, init_weights_normal,
                     scale_residual_weights)
from .moe import MoEFeedForward, grouped_mm_dtype, grouped_mm_syncs
from .routing import ROUTING_MODES, depth_fractions
from .sampling import as_integer, batch_prompts, check_generator, check_sampling, sample_next
from .tied_lookup import HeadGradientSlot, kernel_applies, tied_lookup


def moe_positions(n_blocks: int, n_moe: int) -> list[int]:
    """Indices of the blocks after which an MoE block is inserted (evenly spread, between blocks)."""
    return [(i + 1) * n_blocks // (n_moe + 1) - 1 for i in range(n_moe)]


def check_token_ids(ids: torch.Tensor, vocab_size: int, sync: bool = False, what: str = "token ids",
                    ignore_index: int | None = None) -> None:
    """A clear error for token ids the embedding cannot look up (out of range, or not integers), or targets the
    loss cannot score (``ignore_index`` allowed), where the check is free: on the CPU, or with ``sync`` (generate
    reads the prompt once). A training step on CUDA skips it: its value check would be a host sync inside a
    captured step (the data loader checks its tokens instead, ``data.loader``; the fused loss's kernel gives NaN
    for a target out of range)."""
    if ids.dtype not in (torch.int64, torch.int32):  # what the embedding's lookup takes
        raise ValueError(f"{what} must be an integer tensor (int64 or int32), got {ids.dtype}")
    # Fake tensors (memory estimates trace the model without data) have no values to read.
    if (ids.device.type == "cpu" or sync) and ids.numel() and not torch.compiler.is_compiling() and not is_fake(ids):
        scored = ids if ignore_index is None else ids[ids != ignore_index]
        if not scored.numel():
            return
        lo, hi = int(scored.min()), int(scored.max())
        if lo < 0 or hi >= vocab_size:
            also = "" if ignore_index is None else f" (or {ignore_index}: ignored)"
            raise ValueError(f"{what} must lie in [0, {vocab_size}){also}, got [{lo}, {hi}]")


def _through_eos(tokens: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """A row's new tokens up to and including its first ``eos_token_id`` (all of them without one)."""
    if eos_token_id is None:
        return tokens
    hits = (tokens == eos_token_id).nonzero()
    return tokens[:int(hits[0]) + 1] if len(hits) else tokens


def _recompute_keeps_buffers(block: nn.Module) -> dict:
    """``checkpoint`` options under which backward's recomputation of ``block`` reads its buffers as the forward
    read them and leaves them as the forward left them: its routers fold each training batch's top-k boundary into
    their thresholds in place, so the recomputation would see the folded threshold (``topk_over="causal"`` chooses
    by it: other entries, wrong gradients) and fold it again (decay squared per step). Traced by Dynamo (the whole
    model compiled), the recomputation replays no buffer update, and a custom ``context_fn`` is not traceable
    there, so none is given."""
    if torch.compiler.is_compiling():
        return {}
    buffers = list(block.buffers())

    def contexts():  # one pair per checkpointed call: the forward's snapshot serves its own recomputation
        read: list[torch.Tensor] = []

        @contextlib.contextmanager
        def forward():
            read[:] = [b.clone() for b in buffers]
            yield

        @contextlib.contextmanager
        def recompute():
            left = [b.clone() for b in buffers]
            with torch.no_grad():
                for buffer, value in zip(buffers, read):
                    buffer.copy_(value)
            try:
                yield
            finally:  # the recomputation may end early, by an exception, once it has what backward needs
                with torch.no_grad():
                    for buffer, value in zip(buffers, left):
                        buffer.copy_(value)

        return forward(), recompute()

    return {"context_fn": contexts}


class HydraModel(nn.Module, GradientCheckpointMixin):
    def __init__(self, config: HydraConfig):
        super().__init__()
        config.validate()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.blocks = nn.ModuleList(self._build_blocks(cfg))
        self.moe_blocks = nn.ModuleDict()
        if cfg.moe:
            for i in moe_positions(len(self.blocks), cfg.moe_num_layers):
                self.moe_blocks[str(i)] = MoEFeedForward(cfg.dim, cfg.moe_hidden, cfg.moe_num_experts, cfg.moe_top_k,
                                                         cfg.moe_router_jitter, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.eval_routing = "causal"
        self.gradient_checkpointing = False
        self.checkpoint_every = 1  # with gradient_checkpointing: recompute every N-th block
        # Loss path for forward(targets=...): "naive" (materialise logits), "chunked" (fused, chunked
        # over tokens), "liger" (Liger's fused kernel, CUDA) or "auto" (liger on CUDA when usable).
        self.ce_impl = "naive"
        self.ce_chunk_size = 4096
        self.ce_compile: dict | None = None  # compile_policy.compile_units: compile settings of the loss chunks
        self._decode_sessions = DecodeSessions()  # what generate keeps between calls (decode_session)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _build_blocks(cfg: HydraConfig) -> list[RecursiveBlock]:
        def layer() -> TransformerLayer:
            if cfg.arch == "dense":
                attn = GQAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.attention_backend)
            else:
                attn = CCGQAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.conv_seq_kernel,
                                     cfg.conv_ch_kernel, cfg.qk_mean, cfg.value_shift, cfg.norm_eps,
                                     cfg.attention_backend, cfg.decode_kernel)
            return TransformerLayer(cfg.dim, cfg.mlp_hidden, attn, cfg.norm_eps)

        if cfg.arch == "dense":
            return [RecursiveBlock([layer()], [1.0], cfg, f"layer{i}") for i in range(cfg.n_layers)]

        def routed(index: int, n_routable: int, layers: list[TransformerLayer], name: str,
                   first: bool = True) -> RecursiveBlock:
            return RecursiveBlock(layers, depth_fractions(cfg, index, n_routable, first), cfg, name)

        if cfg.sharing == "middle_cycle":
            middle = [layer() for _ in range(cfg.n_blocks - 2)]
            return [RecursiveBlock([layer()], [1.0], cfg, "first"),
                    routed(0, 1, middle, "middle", first=False),
                    RecursiveBlock([layer()], [1.0], cfg, "last")]
        return [routed(b, cfg.n_blocks, [layer()], f"block{b}") for b in range(cfg.n_blocks)]

    def _init_weights(self) -> None:
        cfg = self.config
        init_weights_normal(self, cfg.init_std)
        residual_writers = []
        for block in self.blocks:
            for lyr in block.layers:
                residual_writers += [lyr.attn.out, lyr.mlp.down]
        scale_residual_weights(residual_writers, cfg.effective_layers, cfg.init_std)
        for moe in self.moe_blocks.values():
            nn.init.normal_(moe.w_gate_up, std=cfg.init_std)
            nn.init.normal_(moe.w_down, std=cfg.init_std / (2 * max(1, cfg.effective_layers)) ** 0.5)

    # ------------------------------------------------------------------ introspection
    def router_names(self) -> list[str]:
        return [name for block in self.blocks for name in block.router_names()]

    def set_curriculum(self, mod_active: bool = True, mor_active: bool = True, mor_ramp: float = 1.0) -> None:
        """Switch MoD / MoR routing on or off (the training curriculum). Off: every token runs
        every block (MoD) / every recursion (MoR) with weight 1. ``mor_ramp`` in [0, 1] moves the
        MoR depth capacities from full depth (0) to the configured ones (1). Changing any of them
        retraces a compiled model once."""
        if isinstance(mor_ramp, bool) or not isinstance(mor_ramp, numbers.Real) or not 0 <= mor_ramp <= 1:
            raise ValueError(f"mor_ramp={mor_ramp!r} must lie in [0, 1] (0: full depth, 1: the configured MoR "
                             "capacities)")
        for block in self.blocks:
            block.mod_active = bool(mod_active)
            block.mor_active = bool(mor_active)
            block.mor_ramp = float(mor_ramp)

    def routing_mode(self, routing: str | None = None) -> str:
        if routing is not None and routing not in ROUTING_MODES:  # a typo is one for a static model too
            raise ValueError(f"routing={routing!r}: must be one of {list(ROUTING_MODES)}")
        if self.config.static_routing_mode:
            return "static"
        if routing is not None:
            return routing
        return "topk" if self.training else self.eval_routing

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                routing: str | None = None, doc_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Logits [B, T, V], ``aux_loss`` (MoD routers), ``ponder_loss`` (MoR routers), ``moe_loss``,
        ``routing_stats`` [n_routers, 3] (executed fraction, mean gate, top-k/causal-rule agreement: NaN for a
        router the curriculum switched off);
        with ``targets``: ``ce_loss`` and ``loss`` (CE plus the weighted router losses); when
        ``model.ce_impl`` is not "naive" the loss is fused with the head and ``logits`` is omitted.
        ``doc_ids`` [B, T] (documents packed in a row): nothing crosses a document boundary."""
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be [batch, length] with both > 0, got shape {list(input_ids.shape)}")
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids must have input_ids' shape {list(input_ids.shape)}, got {list(doc_ids.shape)}")
        if doc_ids is not None and doc_ids.dtype not in (torch.int32, torch.int64):
            # Rows laid end to end get ids offset by the row (doc_attention.documents_end_to_end): a narrower dtype
            # would wrap around and let two rows share a document.
            raise ValueError(f"doc_ids must be int32 or int64, got {doc_ids.dtype}: pass doc_ids.long()")
        b, t = input_ids.shape
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.config.max_seq_len}; "
                             "raise HydraConfig.max_seq_len or feed shorter sequences")
        check_token_ids(input_ids, self.config.vocab_size)
        if targets is not None:
            if targets.shape != input_ids.shape:
                raise ValueError(f"targets must have input_ids' shape {list(input_ids.shape)}, got "
                                 f"{list(targets.shape)}")
            check_token_ids(targets, self.config.vocab_size, what="targets", ignore_index=-100)
        # A tensor of its own, not a view: routed units pass gathered positions (not views) to the
        # same compiled unit, and a view would make its guards differ (compile_policy.compile_units).
        pos = torch.arange(t, device=input_ids.device).repeat(b, 1)
        # Tied weights and the fused loss: its backward leaves the head's gradient in a slot of this forward's own
        # for the lookup's backward to add into (tied_lookup).
        fused_tied = (self.config.tie_embeddings and targets is not None and self.ce_impl != "naive"
                      and torch.is_grad_enabled() and kernel_applies(self.embed.weight))
        slot = HeadGradientSlot(head_gradient_overlap.applies(self.config)) if fused_tied else None
        x = self.embed(input_ids) if slot is None else tied_lookup(input_ids, self.embed.weight, slot)
        # Here, not inside a compiled unit: a bad backend's error is then ours, not Dynamo's, and the
        # row's mask is built once for every unit that sees the whole row.
        doc = None if doc_ids is None else documents_for(doc_ids, self.config.doc_mask_backend,
                                                           self.config.head_dim, x.dtype)
        x, out = self._trunk(x, pos, self.routing_mode(routing), None, doc)
        ce, logits = self._head(x, targets, slot)
        if logits is not None:
            out["logits"] = logits
        if targets is not None:
            out["ce_loss"] = ce
            out["loss"] = self.total_loss(ce, out)
        return out

    def _head(self, x: torch.Tensor, targets: torch.Tensor | None, head_grad: HeadGradientSlot | None = None):
        """Final norm, LM head and (with targets) the cross-entropy: (ce or None, logits or None). ``head_grad``:
        where the fused loss's backward leaves the head's gradient (``tied_lookup``)."""
        h = self.norm(x)
        if targets is not None and self.ce_impl != "naive":
            # Fused head + loss: the [B, T, V] logits are never materialised.
            return linear_cross_entropy(h, self.lm_head.weight, targets, ignore_index=-100, impl=self.ce_impl,
                                        chunk_size=self.ce_chunk_size, compile_chunks=self.ce_compile,
                                        grad_sink=head_grad), None
        logits = self.lm_head(h)
        if targets is None:
            return None, logits
        return logits_cross_entropy(logits, targets, ignore_index=-100), logits

    def total_loss(self, ce: torch.Tensor, out: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.config
        return (ce + cfg.resolved_mod_aux_weight * out["aux_loss"] + cfg.mor_aux_weight * out["ponder_loss"]
                + cfg.moe_aux_weight * out["moe_loss"])

    def _trunk(self, x, pos, mode, caches, doc=None, prefill=None, valid=None):
        mod, mor, moe, stats, loads = [], [], [], [], []
        for i, block in enumerate(self.blocks):
            block_caches = None if caches is None else caches[i]
            if self.gradient_checkpointing and self.training and caches is None and i % self.checkpoint_every == 0:
                # Recompute each block in backward instead of storing its activations.
                x, losses, block_stats = checkpoint(block, x, pos, self.rope, mode, None, doc, use_reentrant=False,
                                                    **_recompute_keeps_buffers(block))
            else:
                x, losses, block_stats = block(x, pos, self.rope, mode, block_caches, doc, prefill, valid)
            mod += losses["mod"]
            mor += losses["mor"]
            stats += block_stats
            if str(i) in self.moe_blocks:
                # Cached decoding routes as the eval forward does whatever the mode: no training jitter.
                x, loss, load = self.moe_blocks[str(i)](x, jitter=caches is None)
                moe.append(loss)
                loads.append(load)
        zero = x.new_zeros((), dtype=torch.float32)
        out = {
            "aux_loss": torch.stack(mod).mean() if mod else zero,
            "ponder_loss": torch.stack(mor).mean() if mor else zero,
            "moe_loss": torch.stack(moe).mean() if moe else zero,
            "routing_stats": torch.stack(stats) if stats else x.new_zeros((0, 3), dtype=torch.float32),
        }
        if loads:
            out["moe_load"] = torch.stack(loads)  # [n_moe_layers, n_experts]: share of each expert's assignments
        return x, out

    # ------------------------------------------------------------------ incremental decoding
    def init_cache(self, batch: int, length: int, device=None, dtype=None) -> list:
        """Per block, per depth, per layer: latent KV slots, conv state and value-shift state. ``dtype``
        (default: autocast's where autocast is on for the device, else the weights'): what autocast computes
        the cached values in, so storing them in it loses nothing and takes half an fp32 cache's memory."""
        if length > self.config.max_seq_len:  # positions past the rotary table: an index error, or on CUDA garbage
            raise ValueError(f"init_cache: a cache of {length} positions is longer than the model's max_seq_len "
                             f"({self.config.max_seq_len}); allocate at most {self.config.max_seq_len}")
        weight = self.embed.weight
        device = torch.device(device or weight.device)
        if dtype is None:
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else weight.dtype
        return [block.new_caches(batch, length, device, dtype) for block in self.blocks]

    @torch.no_grad()  # the caches are written in place: with autograd on, each step's graph would hang on to them
    def forward_cached(self, input_ids: torch.Tensor, start: int | torch.Tensor, caches: list,
                       compiled: bool = False, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Run new tokens at positions start.. through the model, updating ``caches``; returns the
        last position's logits [B, V]. ``start``: an int or a [B, 1] tensor (read back to check that the positions
        fit the caches: a ValueError if not). Positions are consumed in
        order, each once per cache (the conv and value-shift states advance with every token). Every
        routed unit runs, on masked entries up to the last one any row admits (the prompt's prefill;
        ``generate``'s one-token steps run ``decode_step.DecodeStep``, which skips the units no token
        enters). ``compiled``: each block runs one compiled graph (``decode_step.compiled_prefill``, one per
        block layout, the prompt's length a symbol, so every length shares it; a new batch size compiles
        again), its units on all their entries, masked, with no host sync; ``generate`` compiles it when it
        compiles its decode step. ``valid`` [B, T] bool: the tokens of the prompt, first in every row, the rest
        padding (a prompt padded to a length that a compiled or captured prefill has seen): padded entries are
        computed but leave the caches as if they were not there, and the logits are each row's last valid
        entry's. Train or eval mode gives the same logits, the eval forward's (causal routing; MoE without its
        training jitter)."""
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"forward_cached: input_ids must be [batch, new tokens], both at least 1; got shape "
                             f"{tuple(input_ids.shape)}")
        if valid is not None and (valid.dtype != torch.bool or valid.shape != input_ids.shape):
            raise ValueError(f"forward_cached: valid must be a bool tensor of input_ids' shape "
                             f"{tuple(input_ids.shape)}; got {valid.dtype} {tuple(valid.shape)}")
        check_token_ids(input_ids, self.config.vocab_size)
        b, s = input_ids.shape
        rows, length = caches[0][0][0].k.shape[0], caches[0][0][0].k.shape[2]
        if b != rows:
            raise ValueError(f"forward_cached: a batch of {b} rows for caches of {rows}; allocate caches for this "
                             f"batch (init_cache({b}, length))")
        first, last = (start, start) if isinstance(start, int) else (int(start.min()), int(start.max()))  # a read-back
        if not 0 <= first <= last <= length - s:  # past the cache, CUDA's decode kernel would write out of bounds
            raise ValueError(f"forward_cached: positions {first}..{last + s - 1} do not fit a cache of {length} "
                             f"positions; allocate a longer one (init_cache(batch, length))")
        pos = (start + torch.arange(s, device=input_ids.device)).expand(b, s)
        mode = "static" if self.config.static_routing_mode else "causal"
        prefill = compiled_prefill(input_ids.device) if compiled else None
        x = self.embed(input_ids)
        if compiled:  # the prompt's length a symbol from the first call on: one graph for every length
            for t in (x, pos) if valid is None else (x, pos, valid):
                torch._dynamo.maybe_mark_dynamic(t, 1)
        x, _ = self._trunk(x, pos, mode, caches, prefill=prefill, valid=valid)
        last = x[:, -1] if valid is None else x.gather(1, (valid.sum(1) - 1).clamp(min=0)[:, None, None].expand(
            -1, 1, x.shape[-1]))[:, 0]
        return self.lm_head(self.norm(last))

    def decode_capturable(self) -> bool:
        """Whether ``generate`` can replay its steps as a CUDA graph (model on CUDA, current autocast):
        MoE without the bf16 grouped GEMM, or on a GPU its sync-free kernel does not serve, reads offsets on the host
        (``moe.grouped_mm_syncs``)."""
        weight = self.embed.weight
        return weight.is_cuda and (not self.moe_blocks or (grouped_mm_dtype(weight) is not None
                                                           and not grouped_mm_syncs(weight.device)))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | Sequence, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None, cuda_graph: bool | None = None,
                 compile_step: bool | None = None) -> torch.Tensor | list[torch.Tensor]:
        """Prompt [B, T] -> [B, T + max_new_tokens] (stops early once every row emitted ``eos_token_id``).
        Prompts of several lengths, a list of 1-D tensors or of token id lists, decode as one batch, each row from
        the end of its own prompt: the result is a list of 1-D tensors, each its prompt and its new tokens (up to
        and including its first ``eos_token_id``). Greedy, each row gets the tokens its prompt gets on its own (up
        to rounding in fp32 or bf16, where the batch's shapes can turn a near-tie). Sampled, that holds only with
        ``generator`` a sequence of one generator per row (each seeded as that prompt's own would be): one
        generator (or the global one) draws the rows in turn, so a row's tokens depend on the rows before it.

        ``temperature=0`` is greedy decoding; it yields exactly the tokens that repeated full
        forwards in eval (causal routing) mode would pick. The one-token steps after the prompt
        (``decode_step.DecodeStep``) run only the routed units that some row's new token enters.
        ``cuda_graph`` (default: on CUDA): the ops between two routing decisions replay as one CUDA graph
        each (the first step runs eagerly, the second captures); launched one by one, the step's hundreds
        of small kernels leave the GPU idle. ``compile_step`` (default: on CUDA, eager on the CPU;
        ``False`` opts out): every routed unit of the step runs one ``torch.compile``d unit
        (``compiled_decode_unit``, static shapes), shared by all units and blocks, and every router one
        compiled decision (``compiled_decode_decision``), so the graphs replay fused kernels instead of
        many tiny eager ones; the prompt's prefill then runs each block as one compiled graph
        (``compiled_prefill``, the prompt's length dynamic). The first ``generate`` of a (batch, cache length) compiles,
        later ones reuse it. Its cache is then allocated for a power-of-two number of positions (capped at
        ``max_seq_len``), so prompts of similar length share one compilation.

        Where the step is graphed or compiled, the caches, the step with its graphs and (graphed) the prefill's CUDA
        graph per prompt-length bucket are kept for the next call of the same (batch, cache length, settings) while the
        weights stay as they were (``decode_session``); ``release_decode_state()`` frees them. An eager step (the
        CPU's default) keeps nothing past its call.
        """
        ragged = not isinstance(input_ids, torch.Tensor)
        lengths = None
        if ragged:  # padded after each prompt; the prefill leaves the padding out of every cache
            input_ids, lengths = batch_prompts(input_ids, self.embed.weight.device, self.config.vocab_size)
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be [batch>0, length>0], got shape {tuple(input_ids.shape)}")
        input_ids = input_ids.to(self.embed.weight.device)  # as a list of prompts is: the caches go with the weights
        # Python ints from here on (a NumPy integer or a 0-dim integer tensor taken as one, as top_k is)
        if (steps := as_integer(max_new_tokens)) is None or steps < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
        check_sampling(temperature, top_k, top_p)  # before the prefill, and with no token to sample too
        check_generator(generator, input_ids.shape[0])
        eos = None if eos_token_id is None else as_integer(eos_token_id)
        if eos_token_id is not None and (eos is None or not 0 <= eos < self.config.vocab_size):
            raise ValueError(f"eos_token_id={eos_token_id!r} must be an integer in [0, {self.config.vocab_size})")
        max_new_tokens, eos_token_id, top_k = steps, eos, None if top_k is None else as_integer(top_k)
        if not ragged:  # batch_prompts checked each prompt's ids, naming the prompt
            check_token_ids(input_ids, self.config.vocab_size, sync=True)
        b, t = input_ids.shape
        # Positions the caches hold: the prompt's, then one per new token but the last (it is sampled, never fed).
        total = max(t, t + max_new_tokens - 1)
        if total > self.config.max_seq_len:
            raise ValueError(f"{'the longest ' if ragged else ''}prompt ({t}) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds max_seq_len={self.config.max_seq_len} + 1 (the last new token is not fed "
                             "back, so it takes no position)")
        if lengths is not None and bool((lengths == t).all()):
            lengths = None  # one length: the steps' positions as for a tensor prompt
        capturable = input_ids.is_cuda and self.decode_capturable()
        graphed = capturable if cuda_graph is None else cuda_graph
        if graphed and not capturable:
            raise ValueError("cuda_graph=True needs the model and the prompt on a CUDA device and, with MoE, bf16 "
                             "(weights or autocast); pass cuda_graph=False")
        compiled = decode_compiles(input_ids.device, compile_step)
        # Free slots are masked out, so a longer cache gives the same tokens; bucketing its length
        # keeps the compiled step's static shapes (and its compilations) few.
        length = min(self.config.max_seq_len, max(64, 1 << (total - 1).bit_length())) if compiled else total
        # eval for the call, then every submodule's own flag as it was (routers frozen with .eval() stay frozen)
        with eval_mode(self):
            session = None
            try:
                session = self._decode_sessions.get_or_build(self, b, length, input_ids.device, graphed, compiled)
                logits = session.prefill(input_ids, lengths)
                step = session.step
                step.set_prompt_lengths(lengths)
                new = []
                done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
                for i in range(max_new_tokens):
                    nxt = sample_next(logits, temperature, top_k, top_p, generator)
                    if eos_token_id is not None:
                        nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                        done = done | (nxt == eos_token_id)
                    new.append(nxt)
                    if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                        break
                    logits = step(nxt[:, None], t + i)  # the longest prompt's row's position
                new = torch.stack(new, dim=1) if new else input_ids.new_zeros(b, 0)
                if not ragged:
                    return torch.cat((input_ids, new), dim=1)
                counts = [t] * b if lengths is None else lengths.tolist()
                return [torch.cat((input_ids[r, :n], _through_eos(new[r], eos_token_id))) for r, n in enumerate(counts)]
            except BaseException:
                if session is not None:  # interrupted mid-step or mid-capture: not to be reused
                    self._decode_sessions.drop(session)
                raise

    def release_decode_state(self) -> None:
        """Free what ``generate`` keeps between calls (``decode_session``: caches, CUDA graphs and their memory)."""
        self._decode_sessions.clear()

    # ------------------------------------------------------------------ utilities
    def num_parameters(self) -> int:
        """Every parameter once (shared layers once; ``accounting.count_parameters`` splits them up)."""
        return sum(p.numel() for p in self.parameters())

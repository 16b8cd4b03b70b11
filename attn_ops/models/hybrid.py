"""A small hybrid decoder: attention layers (:class:`attn_ops.models.llama.DecoderLayer`) between
recurrent-state layers (Gated DeltaNet, as Qwen3-Next lays them out; Mamba2, as the Mamba2
hybrids do; Mamba1, as Jamba does; or lightning attention, as MiniMax-Text-01 does), each
recurrent layer a pre-norm mixer then an MLP -- on
one allocator, whose blocks page the attention layers' KV caches and whose state slots hold the
recurrent layers' states. Used by the demo, the tests and the benchmarks.

``forward(input_ids [T], positions [T], kv_caches, states, metadata, state_metadata)`` takes a
step's flattened tokens (decodes first), one KV cache per attention layer and one
:class:`~attn_ops.backends.ssm.spec.StateCache` per recurrent layer, the attention layers'
step metadata and the recurrent layers' :class:`~attn_ops.backends.ssm.metadata.StateMetadata`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from attn_ops.backends.ssm.metadata import StateGraphBatch, StateMetadata, build_state_metadata
from attn_ops.cudagraph import CUDAGraphBatch, CUDAGraphRunner
from attn_ops.backends.ssm.spec import (GatedDeltaNetSpec, LightningSpec, Mamba1Spec, Mamba2Spec,
                                       StateCache)
from attn_ops.kv_cache import BlockAllocator
from attn_ops.layers.attention import build_step_metadata, step_backends
from attn_ops.metadata import build_batch
from attn_ops.models.llama import DecoderLayer, ModelConfig, RMSNorm, rope_cache, shared_block_size
from attn_ops.selector import AttentionConfig
from attn_ops.layers.ssm import GatedDeltaNet, LightningAttention, Mamba1Mixer, Mamba2Mixer

__all__ = ["HybridConfig", "HybridGenerator", "HybridGraphRunner", "HybridModel", "LINEAR_KINDS"]

LINEAR_KINDS = ("gated_deltanet", "mamba2", "mamba1", "lightning")  # its recurrent layers


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """``ModelConfig`` plus the recurrent layers: ``linear_kind`` (:data:`LINEAR_KINDS`) and
    every ``full_attention_every``-th layer (3, 7, ... for 4: Qwen3-Next's 3 : 1; Jamba's and
    MiniMax-Text-01's are 8) an attention layer."""

    linear_kind: str = "gated_deltanet"
    full_attention_every: int = 4
    gdn: GatedDeltaNetSpec = GatedDeltaNetSpec(num_k_heads=2, num_v_heads=4, head_k_dim=32,
                                               head_v_dim=32, dtype=torch.float32)
    mamba2: Mamba2Spec = Mamba2Spec(num_heads=8, head_dim=32, d_state=16, n_groups=2,
                                    dtype=torch.float32)
    mamba1: Mamba1Spec = Mamba1Spec(d_inner=128, d_state=16, dtype=torch.float32)
    mamba1_dt_rank: int = 8
    lightning: LightningSpec = LightningSpec(num_heads=4, head_dim=32, dtype=torch.float32)

    def __post_init__(self) -> None:
        if self.linear_kind not in LINEAR_KINDS:
            raise ValueError(f"linear_kind={self.linear_kind!r} must be one of "
                             f"{', '.join(LINEAR_KINDS)}")
        if self.full_attention_every < 1:
            raise ValueError(f"full_attention_every={self.full_attention_every} must be >= 1")

    def is_attention(self, layer: int) -> bool:
        return layer % self.full_attention_every == self.full_attention_every - 1

    @property
    def state_spec(self):
        spec = {"gated_deltanet": self.gdn, "mamba2": self.mamba2, "mamba1": self.mamba1,
                "lightning": self.lightning}[self.linear_kind]
        return dataclasses.replace(spec, dtype=self.dtype)


class RecurrentLayer(nn.Module):
    """``attn_config`` / ``platform``: its mixer's backend selection (per-kind overrides)."""

    def __init__(self, cfg: HybridConfig, index: int,
                 attn_config: AttentionConfig | None = None, platform=None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        select = dict(config=attn_config, platform=platform)
        if cfg.linear_kind == "mamba1":
            self.mixer = Mamba1Mixer(cfg.state_spec, h, cfg.mamba1_dt_rank, **select)
        elif cfg.linear_kind == "lightning":
            spec = cfg.state_spec
            slopes = LightningAttention.minimax_slopes(spec.num_heads, index, cfg.num_layers)
            self.mixer = LightningAttention(spec, h, slopes, cfg.rms_norm_eps, **select)
        else:
            mixer = GatedDeltaNet if cfg.linear_kind == "gated_deltanet" else Mamba2Mixer
            self.mixer = mixer(cfg.state_spec, h, cfg.rms_norm_eps, **select)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x, states: StateCache, state_metadata: StateMetadata):
        x = x + self.mixer(self.input_norm(x), states, state_metadata)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class HybridModel(nn.Module):
    def __init__(self, cfg: HybridConfig, attn_config: AttentionConfig | None = None,
                 platform=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, attn_config, platform) if cfg.is_attention(i)
            else RecurrentLayer(cfg, i, attn_config, platform) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_cache(cfg.head_dim, cfg.max_position, cfg.rope_theta),
                             persistent=False)
        with torch.no_grad():  # (random recurrent parameters: the zero / one inits are inert)
            for layer in self.recurrent_layers:
                for name, p in layer.mixer.named_parameters():
                    if "proj" not in name:
                        p.copy_(torch.randn_like(p) * 0.3)

    @property
    def attention_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    @property
    def recurrent_layers(self) -> list[RecurrentLayer]:
        return [layer for layer in self.layers if isinstance(layer, RecurrentLayer)]

    @property
    def block_size(self) -> int:
        return shared_block_size(self.attention_layers)

    def compile_layers(self, **options) -> HybridModel:
        """Each layer through ``torch.compile(fullgraph=True)`` (one graph per layer kind)."""
        for layer in self.layers:
            layer.compile(**{"fullgraph": True, "dynamic": True, **options})
        return self

    def allocate_kv_caches(self, num_blocks: int, device=None) -> list[torch.Tensor]:
        return [layer.attn.allocate_kv_cache(num_blocks, device)
                for layer in self.attention_layers]

    def allocate_states(self, num_state_slots: int, device=None) -> list[StateCache]:
        """One state cache per recurrent layer: ``num_state_slots`` request slots + the null
        slot."""
        spec = self.cfg.state_spec
        return [spec.allocate(num_state_slots + 1, device or "cpu")
                for _ in self.recurrent_layers]

    def forward(self, input_ids, positions, kv_caches, states, metadata, state_metadata):
        x = self.embed(input_ids)
        cos_sin = self.rope[positions]
        caches, recurrent = iter(kv_caches), iter(states)
        for layer in self.layers:
            if isinstance(layer, DecoderLayer):
                x = layer(x, cos_sin, positions, next(caches), metadata)
            else:
                x = layer(x, next(recurrent), state_metadata)
        return self.lm_head(self.norm(x)).float()


class HybridGraphRunner(CUDAGraphRunner):
    """:class:`~attn_ops.cudagraph.CUDAGraphRunner` for :class:`HybridModel`: the step's state
    metadata is padded into :class:`~attn_ops.backends.ssm.metadata.StateGraphBatch`'s
    persistent buffers too (padding requests on the null slot), and the graph is captured with
    the state caches and those buffers."""

    def __init__(self, model: HybridModel, forward, graphs: CUDAGraphBatch,
                 kv_caches: list, states: list[StateCache]) -> None:
        super().__init__(model, forward, graphs, kv_caches)
        self.states = states
        self.state_graphs = StateGraphBatch(graphs, model.cfg.state_spec.chunk_size)
        self._state_meta: dict[int, StateMetadata] = {}

    def __call__(self, input_ids, common, state_metadata: StateMetadata):
        size = self.graphs.size_for(common.num_reqs)
        padded = self.state_graphs.pad(state_metadata)
        self._state_meta.setdefault(size, padded)  # (the views the graph of this size reads)
        return super().__call__(input_ids, common)

    def forward_args(self, rows: int, step: dict) -> tuple:
        size = rows // self.graphs.query_len
        return (self.input_ids[:rows], self.positions[:rows], self.kv_caches, self.states, step,
                self._state_meta[size])

    def _capture(self, rows: int, step: dict):
        """The base's warm-up runs advance the batch's states in place (a KV write is
        idempotent, a recurrence is not): the batch's slots are saved before and put back
        after, so the first replay starts from the states the step was given."""
        slots = self._state_meta[rows // self.graphs.query_len].state_indices.long()
        tensors = [t for cache in self.states for t in cache if t is not None]
        saved = [t[slots].clone() for t in tensors]
        captured = super()._capture(rows, step)
        for t, s in zip(tensors, saved):
            t.index_copy_(0, slots, s)
        return captured


class HybridGenerator:
    """Greedy generation over one allocator (KV blocks and state slots), one mixed batch a
    step, decodes first; ``forward`` is the model or a compiled version of it. With
    ``capture_sizes`` (GPUs), decode-only steps of at most the largest size replay CUDA graphs
    (:class:`HybridGraphRunner`); other steps run ``forward``.

    ``prefix_caching``: a prompt's full blocks are cached with the recurrent states after each
    step that ends on a block boundary (a checkpoint: every layer's states copied into a spare
    state slot), and a prefill's steps end where the allocator places checkpoints
    (:meth:`~attn_ops.kv_cache.BlockAllocator.next_checkpoint`: every ``checkpoint_every``
    blocks and the prompt's last full block). A request whose prompt starts with a cached
    prefix takes its blocks and the states of the last checkpointed block, and computes from
    there (:attr:`computed_on_add`). A request added while a running one is still prefilling
    a prefix it shares waits (:attr:`waiting`) until that one has computed the last full block
    of the shared part -- where its prefill now also stops for a checkpoint, whatever the
    policy -- then resumes from it: a batch of requests over one long prefix computes it once,
    and up to its last block boundary."""

    def __init__(self, model: HybridModel, num_blocks: int, num_state_slots: int, forward=None,
                 *, max_model_len: int = 1024, device="cpu",
                 capture_sizes: tuple[int, ...] | None = None,
                 prefix_caching: bool = False, checkpoint_every: int = 64) -> None:
        self.model = model
        self.backends = step_backends(model)
        self.forward = model if forward is None else forward
        self.device = device
        self.max_blocks_per_req = -(-max_model_len // model.block_size)
        self.allocator = BlockAllocator(num_blocks, model.block_size, shuffle=True,
                                        num_state_slots=num_state_slots,
                                        prefix_caching=prefix_caching,
                                        checkpoint_every=checkpoint_every)
        self.computed_on_add: dict[int, int] = {}  # request -> prompt tokens it skipped
        self.tokens_computed = 0  # every step's new tokens, all requests
        self.step_ids: list[int] = []  # the last step's requests, in its logits' row order
        self.prompt_lens: dict[int, int] = {}
        self._stops: dict[int, set[int]] = {}  # request -> where waiting requests resume
        # request -> (its prompt, the running request it waits for, the position it resumes at)
        self.waiting: dict[int, tuple[list[int], int, int]] = {}
        self.kv_caches = model.allocate_kv_caches(num_blocks, device)
        self.states = model.allocate_states(num_state_slots, device)
        self.requests: dict[int, list] = {}  # request -> [tokens, num_computed]
        self.runner = None
        if capture_sizes:
            graphs = CUDAGraphBatch(capture_sizes, self.max_blocks_per_req, model.block_size,
                                    device)
            self.runner = HybridGraphRunner(model, self.forward, graphs, self.kv_caches,
                                            self.states)

    def add(self, request_id: int, prompt: list[int]) -> None:
        lead = self._leader(prompt) if self.allocator.prefix_caching else None
        if lead is not None:
            self.waiting[request_id] = (list(prompt), *lead)
            self._stops.setdefault(lead[0], set()).add(lead[1])
            return
        self._admit(request_id, prompt)

    def _leader(self, prompt: list[int]) -> tuple[int, int] | None:
        """``(request, position)``: the running request still to prefill the deepest block
        boundary of the prompt tokens ``prompt`` shares with it (at most its last token but
        one), and that boundary; None where no running request is."""
        best, bs = None, self.allocator.block_size
        for r, (tokens, done) in self.requests.items():
            common = 0
            for a, b in zip(tokens[:min(self.prompt_lens[r], len(prompt) - 1)], prompt):
                if a != b:
                    break
                common += 1
            at = common // bs * bs
            if at > done and (best is None or at > best[1]):
                best = (r, at)
        return best

    def _admit(self, request_id: int, prompt: list[int]) -> None:
        alloc = self.allocator
        done = alloc.match_prefix(request_id, prompt, with_checkpoint=True)
        if done:  # (the states after its cached prefix, into the request's own slot)
            self._copy_states(alloc.checkpoint(alloc.blocks(request_id)[-1]),
                              alloc.state_slot(request_id))
        self.computed_on_add[request_id] = done
        self.requests[request_id] = [list(prompt), done]
        self.prompt_lens[request_id] = len(prompt)

    def _copy_states(self, src: int, dst: int) -> None:
        for cache in self.states:
            for t in cache:
                if t is not None:
                    t[dst] = t[src]

    def _cache_prefixes(self, ids, new) -> None:
        """Register the requests' full blocks and checkpoint the states of those whose step
        ended on a block boundary inside their prompt."""
        alloc, bs = self.allocator, self.allocator.block_size
        for r, n in zip(ids, new):
            tokens, done = self.requests[r]
            alloc.reserve(r, done, token_ids=tokens[:done])
            if n and done % bs == 0 and done < len(tokens):
                slot = alloc.new_checkpoint(alloc.blocks(r)[done // bs - 1])
                if slot is not None:
                    self._copy_states(alloc.state_slot(r), slot)

    def free(self, request_id: int) -> None:
        if self.waiting.pop(request_id, None) is None:
            self.requests.pop(request_id)
            self.prompt_lens.pop(request_id)
            self._stops.pop(request_id, None)
            self.allocator.free(request_id)

    def _admit_waiting(self) -> None:
        """Admit the waiting requests whose leader made their checkpoint or left."""
        for r, (prompt, lead, at) in list(self.waiting.items()):
            if lead not in self.requests or self.requests[lead][1] >= at:
                del self.waiting[r]
                self._admit(r, prompt)

    @torch.inference_mode()
    def step(self, max_new_tokens: int | None = None) -> torch.Tensor:
        """One step over every request (at most ``max_new_tokens`` of a prompt at once: chunked
        prefill) -- the running ones: not those still :attr:`waiting` -- and returns the
        last-token logits ``[B, vocab]``."""
        self._admit_waiting()
        reqs = self.requests
        todo = {r: len(t) - n for r, (t, n) in reqs.items()}
        if max_new_tokens is not None:
            todo = {r: min(n, max_new_tokens) for r, n in todo.items()}
        if self.allocator.prefix_caching:  # (prefill steps end at the prompts' checkpoints)
            for r, n in todo.items():
                done = reqs[r][1]
                stops = [p for p in self._stops.get(r, ()) if p > done]
                policy = self.allocator.next_checkpoint(done, self.prompt_lens[r])
                stops += [policy] if policy is not None else []
                todo[r] = min([n, *(p - done for p in stops)])
        ids = sorted(reqs, key=lambda r: not (reqs[r][1] and todo[r] == 1))
        context = [reqs[r][1] for r in ids]
        new = [todo[r] for r in ids]
        meta = build_batch(self.allocator, ids, context, new, device=self.device,
                           max_blocks_per_req=self.max_blocks_per_req)
        state_meta = build_state_metadata(meta.query_start_loc_cpu, context,
                                          self.allocator.state_slots(ids),
                                          self.model.cfg.state_spec.chunk_size,
                                          device=self.device)
        input_ids = torch.tensor([t for r in ids
                                  for t in reqs[r][0][reqs[r][1]:reqs[r][1] + todo[r]]],
                                 device=self.device)
        if (self.runner is not None and all(n == 1 for n in new) and all(context)
                and len(ids) <= self.runner.graphs.capture_sizes[-1]):
            logits = self.runner(input_ids, meta, state_meta)
        else:
            step = build_step_metadata(self.backends, meta)
            logits = self.forward(input_ids, meta.positions, self.kv_caches, self.states, step,
                                  state_meta)
        last = logits[meta.query_start_loc_cpu[1:].long() - 1]
        self.step_ids, self.tokens_computed = ids, self.tokens_computed + sum(new)
        for r, n, row in zip(ids, new, last.argmax(-1).tolist()):
            reqs[r][1] += n
            if reqs[r][1] == len(reqs[r][0]):
                reqs[r][0].append(row)
        if self.allocator.prefix_caching:
            self._cache_prefixes(ids, new)
        return last

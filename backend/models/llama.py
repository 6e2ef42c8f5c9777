"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE), chosen by the config.

Module names follow the HF checkpoints except for two fusions that save matmuls:
q/k/v -> `qkv_proj` and gate/up -> `gate_up_proj` (the loader concatenates them).
Qwen3 adds a per-head RMSNorm on q and on k before rotary (`q_norm`, `k_norm`, ModelArgs.qk_norm).
Mixtral differs only in its MLP: a sparse mixture of experts (`layers.moe`) under the
name `mlp`, with the experts' weights stacked. Qwen3-MoE is Qwen3's attention with such MLPs,
some layers keeping a dense one (ModelArgs.dense_mlp_layers). Phi-3 / Phi-4-mini checkpoints
store qkv_proj and gate_up_proj fused already (same layout as ours); their rope may turn only
the first ModelArgs.rotary_dim features of each head.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from splitfuse.kernels.cpu import decoder as cpu_decoder
from splitfuse.layers.attention import AttentionMetadata
from splitfuse.layers.embedding import Embedding
from splitfuse.layers.int8_linear import CpuInt8Linear
from splitfuse.layers.kernels import KernelSet
from splitfuse.layers.linear import CpuLinear, Linear, fuses_swiglu
from splitfuse.layers.moe import Experts, SparseMoeBlock
from splitfuse.layers.partial_rotary import apply_partial_rotary
from splitfuse.layers.q4_linear import GGUF_QUANTIZATIONS, HEAD_QUANTIZATION, LOAD_QUANTIZATIONS, CpuQ4Linear
from splitfuse.models.args import ModelArgs

if TYPE_CHECKING:
    from splitfuse.lora.batching import LoraState

log = logging.getLogger(__name__)

# Rows to keep after the last layer's K/V write, and the attention metadata of those rows alone.
Keep = tuple[torch.Tensor, AttentionMetadata]

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelSet) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, ops: KernelSet) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.rotary_dim = args.rotary_dim or args.head_dim  # Phi-4-mini: rope on 3/4 of each head
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        # Per-head norms (Qwen3): one weight of head_dim, shared by all heads, so tensor-parallel
        # ranks hold it whole.
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, ops) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, ops) if args.qk_norm else None
        self.scale = args.attention_scale or args.head_dim**-0.5
        self.sliding_window = args.sliding_windows[layer_idx]
        self.ops = ops

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keep: Keep | None = None) -> torch.Tensor | None:
        """Every row writes its K/V; with `keep` = (rows, their metadata) only those rows attend
        and come out (None when there are none)."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(tokens, self.num_kv_heads, self.head_dim)
        if self.rotary_dim < self.head_dim:
            q, k = apply_partial_rotary(self.ops.apply_rotary, q, k, positions, cos, sin, self.rotary_dim)
        else:
            q, k = self.ops.apply_rotary(q, k, positions, cos, sin)
        attn = self.ops.attention
        attn.write_kv(k, v, k_cache, v_cache, meta)
        if keep is not None:
            rows, meta = keep
            if rows.numel() == 0:
                return None
            q = q.index_select(0, rows)
        o = attn.attend(q, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(q.shape[0], self.q_size))


class MLP(nn.Module):
    fuses_silu = True  # SwiGLU: gate_up_proj returns silu(gate) * up (fused into the product where it can)

    def __init__(self, args: ModelArgs, ops: KernelSet) -> None:
        super().__init__()
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias,
                                   silu_and_mul=ops.silu_and_mul if self.fuses_silu else None)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _projections(layer: "DecoderLayer") -> tuple:
    """A dense layer's projection kernels: qkv, o, gate_up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj.kernel, attn.o_proj.kernel, mlp.gate_up_proj.kernel, mlp.down_proj.kernel


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, ops: KernelSet,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] = _identity) -> None:
        super().__init__()
        # Tensor parallelism: attention's and the MLP's outputs are partial sums of this rank's
        # heads / intermediate features (row-parallel o_proj, down_proj); summed across ranks here.
        self.all_reduce = all_reduce
        self.self_attn = Attention(args, layer_idx, ops)
        self.mlp: nn.Module
        if args.num_experts and layer_idx not in args.dense_mlp_layers:
            self.mlp = SparseMoeBlock(args.hidden_size, args.expert_intermediate_size,
                                      args.num_experts, args.num_experts_per_tok, ops, args.norm_topk_prob,
                                      args.routing_weights_in_model_dtype)
        else:
            self.mlp = MLP(args, ops)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)

    def forward(self, x, residual, positions, meta, k_cache, v_cache, cos, sin, keep: Keep | None = None):
        """With `keep` (the last layer): the outputs of the kept rows only."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        a = self.self_attn(h, positions, meta, k_cache, v_cache, cos, sin, keep)
        if keep is not None:
            if a is None:  # no row to keep (every rank of a tensor-parallel group alike)
                return h[:0], residual[:0]
            residual = residual.index_select(0, keep[0])
        h, residual = self.post_attention_layernorm(self.all_reduce(a), residual)
        return self.all_reduce(self.mlp(h)), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, ops: KernelSet, all_reduce: Callable | None = None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, ops, all_reduce or _identity)
                                    for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    model_class: type[nn.Module] = LlamaModel  # the decoder under `model` (Gemma 3 gives its own)

    def __init__(self, args: ModelArgs, ops: KernelSet, all_reduce: Callable | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = self.model_class(args, ops, all_reduce)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Set by prepare_decoder_stack: the decoder layers in one C++ call.
        self.decoder_stack: cpu_decoder.DecoderStack | None = None
        # Set by attach_lora: the step's LoRA adapters (splitfuse.lora.batching.LoraState).
        self.lora_state: LoraState | None = None
        self._logged_stack_declined = False
        # Whether the decoder stack adds LoRA deltas itself (when the stacks run the C++ linear
        # kernel), and the version of the LoRA stacks it was last given.
        self._stack_takes_lora = False
        self._stack_lora_version = -1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor, sin: torch.Tensor,
                keep: Keep | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of the ragged batch; with `keep` = (rows,
        their attention metadata), [len(rows), hidden] of those rows: the last layer computes
        nothing else (every row's K/V is still written). A pipeline stage after the first takes
        the previous stage's output as `hidden`; one before the last (no final norm) returns
        its last layer's output and residual summed, the next layer's input."""
        h = self.model.embed_tokens(input_ids) if hidden is None else hidden
        residual = None
        last = len(self.model.layers) - 1
        start = 0
        stack = self.decoder_stack
        lora_slots = None
        state = self.lora_state
        if stack is not None and state is not None and state.active:
            rows = state.step_rows
            if self._stack_takes_lora and rows.row_slot is not None:  # the C++ stack adds the deltas
                self._sync_stack_lora()
                lora_slots = rows.row_slot
            else:  # LoRA stacks not packed for the C++ kernel: the Python layers' hooks add the deltas
                stack = None
                if not self._logged_stack_declined:
                    self._logged_stack_declined = True
                    log.info("splitfuse: the LoRA stacks do not run the C++ linear kernel: steps with adapter rows "
                             "run the decoder layers in Python")
        if stack is not None:
            # All layers in one call, but a last layer that keeps some rows only (Python's).
            start = last if keep is not None else last + 1
            if start:
                h, residual = stack.run(h, start, positions, cos, sin, meta.slot_mapping,
                                        meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                        lora_row_slot=lora_slots)
        for i in range(start, last + 1):
            k_cache, v_cache = kv_caches[i]
            h, residual = self.model.layers[i](h, residual, positions, meta, k_cache, v_cache, cos, sin,
                                               keep if i == last else None)
        if h.shape[0] == 0:
            return h
        if self.model.norm is None:
            return h + residual
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def prepare_decoder_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
        """Run the decoder layers in one C++ call (`splitfuse.kernels.cpu.decoder`): the kernels
        and arguments of the layers' Python without the Python between them (bit-identical
        results). For dense models whose layers all run the C++ CPU kernels in float32 or
        bfloat16 (projections float or int8; GGUF blocks in float32 models), with the KV cache in
        the model's dtype (or int8) and no tensor parallelism. With LoRA attached, the stack also adds the adapters' deltas (in
        steps of any size) when the stacks run the C++ linear kernel; otherwise steps with adapter
        rows run the Python layers. Call after prepare_linears; returns None
        when set, else why not."""
        layers = self.model.layers
        if not cpu_decoder.available():
            return "the C++ kernel library has no decoder entry point"
        if not layers[0].self_attn.ops.native_cpu:
            return "attention or the elementwise ops are not the C++ CPU kernels"
        if self.args.num_experts:
            return "a mixture-of-experts MLP"
        if self.args.qk_norm:
            return "q/k norm is not in the fused decoder"
        if self.args.rotary_dim and self.args.rotary_dim != self.args.head_dim:
            return "partial rotary (rope on part of each head) is not in the fused decoder"
        if any(layer.all_reduce is not _identity for layer in layers):
            return "tensor parallelism"
        projections = [_projections(layer) for layer in layers]
        int8 = {(k.levels, k.zero_point) for kernels in projections for k in kernels if isinstance(k, CpuInt8Linear)}
        if len(int8) > 1:
            return "int8 projections quantizing their inputs in different ways"
        dtype = layers[0].input_layernorm.weight.dtype
        stack = []
        for layer, kernels, (k_cache, v_cache) in zip(layers, projections, kv_caches):
            attn = layer.self_attn
            if not all(isinstance(k, (CpuLinear, CpuInt8Linear, CpuQ4Linear)) for k in kernels):
                return "projections not all through the C++ linear kernels (oneDNN, torch or another backend)"
            if dtype is not torch.float32 and any(isinstance(k, CpuQ4Linear) for k in kernels):
                return f"GGUF blocks in a {dtype} model (their kernel is float32)"
            if not fuses_swiglu(kernels[2]) and layer.mlp.gate_up_proj.lora is None:
                return "a gate_up projection without the fused SwiGLU"
            if k_cache.dtype is not dtype and k_cache.dtype is not torch.int8:  # (int8: the write quantizes)
                return f"a {k_cache.dtype} KV cache in a {dtype} model"
            stack.append(cpu_decoder.DecoderLayerWeights(
                qkv=kernels[0].packed, o=kernels[1].packed, gate_up=kernels[2].packed, down=kernels[3].packed,
                input_norm=layer.input_layernorm.weight.data, post_norm=layer.post_attention_layernorm.weight.data,
                k_cache=k_cache, v_cache=v_cache, sliding_window=attn.sliding_window))
        a = self.args
        levels, zero_point = int8.pop() if int8 else (127, 128)
        self.decoder_stack = cpu_decoder.DecoderStack(stack, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                                                      head_dim=a.head_dim, eps=a.rms_norm_eps,
                                                      scale=layers[0].self_attn.scale, int8_levels=levels,
                                                      int8_zero_point=zero_point)
        self._stack_takes_lora = self.lora_state is not None and self._stack_lora_weights() is not None
        return None

    def _stack_lora_weights(self) -> list[list[cpu_decoder.LoraWeights | None]] | None:
        """The LoRA stacks as the decoder stack takes them (per layer: qkv, o, gate_up, down), or
        None when their products are not the C++ linear kernel's in the model's dtype."""
        stacks = self.lora_state.stacks
        dtype = self.model.layers[0].input_layernorm.weight.dtype
        out = []
        for i in range(len(self.model.layers)):
            row = []
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                sp = stacks.projections.get((i, name))
                if sp is None:
                    row.append(None)
                    continue
                kernels = [sp.a_kernel, *(p.b_kernel for p in sp.parts)]
                if not all(isinstance(k, CpuLinear) and k.packed.dtype is dtype for k in kernels):
                    return None
                row.append(cpu_decoder.LoraWeights(sp.a_kernel.packed, sp.col_slot,
                                                   [(p.b_kernel.packed, p.col_start, p.out_start) for p in sp.parts]))
            out.append(row)
        return out

    def _sync_stack_lora(self) -> None:
        """Give the decoder stack the LoRA stacks' current kernels (they are rebuilt when an adapter
        is loaded into a slot)."""
        stacks = self.lora_state.stacks
        if self._stack_lora_version != stacks.version:
            self.decoder_stack.set_lora(self._stack_lora_weights())
            self._stack_lora_version = stacks.version

    def attach_lora(self, state: LoraState, hook: Callable[[int, str], Callable], projections: set[str]) -> None:
        """Give the `projections` (our names: qkv_proj, o_proj, gate_up_proj, down_proj) of every
        layer the LoRA hook `hook(layer, name)`, `state` being the step's adapters. Before
        prepare_linears (a hooked gate_up_proj is prepared without the fused activation)."""
        for i, layer in enumerate(self.model.layers):
            modules = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj}
            if isinstance(layer.mlp, MLP):
                modules.update(gate_up_proj=layer.mlp.gate_up_proj, down_proj=layer.mlp.down_proj)
            for name, module in modules.items():
                if name in projections:
                    module.lora = hook(i, name)
        self.lora_state = state

    def prepare_linears(self, backend: str, quantization: str = "none") -> None:
        """Give every projection its kernel for `backend` and `quantization` (after the weights
        are loaded). The LM head and the MoE routers stay in float: their outputs pick tokens and
        experts, and they are a small share of the work; but a GGUF file's head is multiplied
        from the file's own blocks (as llama.cpp does): in fp32 it is a fifth of the bytes a
        SmolLM2 decode step streams (113 of 537 MB). Under a load quantization (q4_0 ...) the head
        and the embedding take 8-bit blocks (HEAD_QUANTIZATION)."""
        routers = {id(m.gate) for m in self.modules() if isinstance(m, SparseMoeBlock)}
        head_quantization = (HEAD_QUANTIZATION if quantization in LOAD_QUANTIZATIONS
                             else quantization if quantization in GGUF_QUANTIZATIONS else "none")
        for module in self.modules():
            if module is self.lm_head:  # a tied head shares its weight with the embedding
                module.prepare(backend, head_quantization, release_weight=not self.args.tie_word_embeddings)
            elif id(module) in routers:
                module.prepare(backend)
            elif isinstance(module, (Linear, Experts)):
                module.prepare(backend, quantization)
        # The embedding on blocks frees its float table, unless a tied head still multiplies that
        # table (its kernel then has no blocks of its own). A tied head's packed blocks are the
        # table's own: the embedding may look its rows up there instead of making a second copy.
        embedding, head = self.model.embed_tokens, self.lm_head.kernel if self.lm_head is not None else None
        if embedding is None:  # a pipeline stage after the first (and without a tied head)
            return
        tied_blocks = isinstance(head, CpuQ4Linear) and self.args.tie_word_embeddings
        if (embedding.prepare(head_quantization, head.packed if tied_blocks else None)
                and (tied_blocks or not self.args.tie_word_embeddings)):
            embedding.weight.data = torch.empty(0, dtype=embedding.weight.dtype, device=embedding.weight.device)

    def weight_memory(self) -> dict[str, int]:
        """Bytes of weights held, by dtype: parameters still stored plus packed kernels' copies."""
        totals: dict[str, int] = {}

        def add(dtype: str, nbytes: int) -> None:
            totals[dtype] = totals.get(dtype, 0) + nbytes

        for p in self.parameters():
            add(str(p.dtype).removeprefix("torch."), p.numel() * p.element_size())
        for module in self.modules():
            kernels = [module.kernel] if isinstance(module, Linear) else (
                module.gate_up + module.down if isinstance(module, Experts) else
                [module] if isinstance(module, Embedding) else [])
            for kernel in kernels:
                for dtype, nbytes in getattr(kernel, "weight_bytes", {}).items():
                    add(dtype, nbytes)
        return totals

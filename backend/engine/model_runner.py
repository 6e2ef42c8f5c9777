"""Owns the model, the KV-cache tensors and the attention backend; runs one ragged batch."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque

import torch

from splitfuse.engine.block_manager import longest_sequence, pool_blocks_for
from splitfuse.config import BLOCK_QUANTIZATIONS, EngineConfig
from splitfuse.utils.cpu_budget import available_cpus
from splitfuse.utils.host_allocator import keep_freed_memory, release_freed_memory
from splitfuse.utils.memory_budget import AUTO_KV_SHARE, auto_kv_cache_bytes, memory_bound
from splitfuse.kernels.cpu.paged_attention import huge_page_empty
from splitfuse.layers.attention import resolve_backend, resolve_kv_cache_dtype
from splitfuse.layers.kernels import KernelSet
from splitfuse.kv_tiers import block_codec
from splitfuse.kv_tiers.fingerprint import KVFingerprint, model_files_identity
from splitfuse.layers.linear import check_quantization, make_linear_kernel, native_bf16_cpu, resolve_linear_backend
from splitfuse.layers.rope_tables import RopeTables, build_rope_tables
from splitfuse.lora.adapter import TARGETS, BaseShape, LoraAdapter
from splitfuse.lora.batching import LoraProjection, LoraState
from splitfuse.lora.registry import LoraRegistry
from splitfuse.models.args import ModelArgs
from splitfuse.models.layer_range import LayerRange, split_layers
from splitfuse.models.loader import load_model, log_load, read_hf_config
from splitfuse.parallel.group import RankGroup, rank_device
from splitfuse.parallel.pipeline import StageLink
from splitfuse.parallel.sharding import Sharder, local_args
from splitfuse.engine.batch import RaggedBatch
from splitfuse.engine.micro_batches import MicroBatches
from splitfuse.engine.quantization import resolve_quantization
from splitfuse.engine.sampler import SampledToken, Sampler
from splitfuse.engine.stage_sampling import StageSampling

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def resolve_dtype(name: str, args: ModelArgs, device: torch.device, quantization: str = "none") -> torch.dtype:
    """`dtype=auto`: float32 under a GGUF block quantization (its kernel takes float32
    activations); else the checkpoint's dtype on GPUs; on CPUs a bfloat16 checkpoint stays bfloat16
    where bf16 runs at least as fast as float32 (layers.linear.native_bf16_cpu: AVX-512 BF16 or AMX,
    or the C++ kernels' AVX2 build, which widens bf16 weights in registers), everything else runs
    float32 (bf16 widened by torch's generic paths is slower than fp32 itself).
    The choice and its reason are logged."""
    if name != "auto":
        return _DTYPES[name]
    if quantization in BLOCK_QUANTIZATIONS:
        log.info("splitfuse: dtype=auto -> float32: quantization=%s multiplies float32 activations", quantization)
        return torch.float32
    checkpoint = str(args.checkpoint_dtype).removeprefix("torch.")
    if device.type != "cpu":
        return _DTYPES.get(checkpoint, torch.bfloat16)
    native, why = native_bf16_cpu()
    if checkpoint == "bfloat16" and native:
        log.info("splitfuse: dtype=auto -> bfloat16: a bfloat16 checkpoint on a CPU with %s", why)
        return torch.bfloat16
    reason = f"a {checkpoint} checkpoint" if checkpoint != "bfloat16" else f"this CPU has {why}"
    log.info("splitfuse: dtype=auto -> float32: %s (set dtype=bfloat16 to choose otherwise)", reason)
    return torch.float32


def threads_per_rank(config: EngineConfig) -> int:
    """CPU threads of one rank: `num_threads` (or the cores this process may use) divided among
    the ranks (tensor-parallel ranks times pipeline stages) of this machine."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if ranks == 1:
        return config.num_threads or min(torch.get_num_threads(), available_cpus())
    total = config.num_threads or available_cpus()
    return max(1, total // ranks)


class ModelRunner:
    def __init__(self, config: EngineConfig, group: RankGroup | None = None) -> None:
        """`group` is given on ranks 1..N-1 (parallel/worker.py); the engine's runner, rank 0,
        starts the group itself when `tensor_parallel_size` or `pipeline_parallel_size` > 1."""
        self.config = config
        # Also on this thread's OpenMP setting, which the C++ kernels' parallel regions read
        # (torch passes its own count to each of its regions); the engine steps on the thread
        # that built it.
        torch.set_num_threads(threads_per_rank(config))
        self.hf_config = read_hf_config(config.model)
        full_args = ModelArgs.from_hf_config(self.hf_config)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        rank = group.rank if group is not None else 0
        # A tensor-parallel rank builds its own heads, KV heads and MLP share (parallel/sharding.py).
        self.args = local_args(full_args, tp) if tp > 1 else full_args
        # A pipeline stage builds its own range of layers and their KV cache (models/layer_range.py).
        stages = split_layers(full_args.num_layers, pp, full_args.tie_word_embeddings)
        self.layers: LayerRange = stages[rank // tp]
        self._kv_layers = max(r.end - r.first for r in stages)  # the same block count fits every stage
        self.device = resolve_device(config.device)
        if tp * pp > 1:
            self.device = rank_device(self.device, rank)
        if self.device.type == "cpu":
            # SiLU/exp on denormal floats is ~20x slower on x86; flushing them to zero changes
            # nothing at the precision that matters (values below 1e-38). A per-thread setting:
            # the engine steps on the thread that built it.
            torch.set_flush_denormal(True)
            keep_freed_memory()
        self.quantization = resolve_quantization(config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.args, self.device, self.quantization)
        self.attention_backend = resolve_backend(config.attention_backend, self.device, self.dtype, config.block_size)
        self.linear_backend = resolve_linear_backend(config.linear_backend, self.device, self.dtype,
                                                     self.quantization)
        check_quantization(self.quantization, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.attention_backend)
        self.kernels = KernelSet.create(self.attention_backend, self.dtype)
        self.max_model_len = min(config.max_model_len or self.args.max_position_embeddings,
                                 self.args.max_position_embeddings)
        self.num_kv_blocks = 0
        if config.kv_cache_memory_gb != "auto":  # auto sizes the pool once the weights are in
            self._size_kv_cache()
        self.pooled_hidden: torch.Tensor | None = None
        """The last step's embedding rows' final hidden states (RaggedBatch.pool_rows), float32."""
        self.leader = None
        if tp * pp > 1 and group is None:
            from splitfuse.parallel.leader import Leader

            # The other ranks build from rank 0's config, with the KV block count it decided.
            self.leader = Leader(dataclasses.replace(config, num_kv_blocks=self.num_kv_blocks), self.device)
            group = self.leader.group
        elif group is not None:
            group.open_compute(self.device, config.tensor_parallel_timeout_s, tp)
        self.group = group
        self.pipe = StageLink(group, config.tensor_parallel_timeout_s) if pp > 1 else None
        self.sampler: Sampler | None = None  # the last pipeline stage's (_stage_sampler)
        self._launched: deque[tuple[RaggedBatch | MicroBatches, torch.Tensor | None, int]] = deque()
        """Batches launched, not yet collected: (batch, its logits on one stage, its pipeline step)."""
        try:
            self._load(full_args)
        except BaseException as e:
            if self.leader is not None:
                self.leader.abort(f"rank 0 failed to load: {type(e).__name__}: {e}")
            raise

    def _load(self, full_args: ModelArgs) -> None:
        config, group, tp = self.config, self.group, self.config.tensor_parallel_size
        shard = Sharder(full_args, group.tp_rank, tp) if tp > 1 else None
        started = time.perf_counter()
        self.model = load_model(config.model, self.args, self.kernels, self.dtype, self.device, shard=shard,
                                all_reduce=group.all_reduce if tp > 1 else None, quantization=self.quantization,
                                layers=self.layers if self.layers.end - self.layers.first < full_args.num_layers
                                else None)
        self._attach_lora()
        self.model.prepare_linears(self.linear_backend, self.quantization)
        release_freed_memory()  # packing's temporaries, before the KV pool is allocated
        log_load(config.model, time.perf_counter() - started, self.weight_memory_summary())
        if not self.num_kv_blocks:
            self._size_kv_cache()
        log.info("splitfuse: device=%s dtype=%s kv_cache_dtype=%s attention_backend=%s (requested %s) "
                 "linear_backend=%s (requested %s) quantization=%s weights=%s threads=%d", self.device,
                 str(self.dtype).removeprefix("torch."), str(self.kv_cache_dtype).removeprefix("torch."),
                 self.attention_backend, config.attention_backend,
                 self.linear_backend, config.linear_backend, self.quantization, self.weight_memory_summary(),
                 torch.get_num_threads())
        if self.quantization == "int8":
            log.warning("splitfuse: quantization=int8 costs quality: weights per output channel and activations "
                        "per token in int8 raised a trained model's perplexity over float32 by about 3% with "
                        "the C++ kernel (AVX-512 VNNI; 8-bit activations on every ISA) and 9% through oneDNN's 7-bit "
                        "activations on AVX2, and its greedy answers "
                        "leave float32's within a few tokens (perf/results/2026-11-27-perplexity/); dtype=bfloat16 alone "
                        "costs under 0.1%")
        a = self.args
        # LongRoPE's table holds two sets; each sequence reads one at its Sequence.rope_offset.
        self.rope: RopeTables = build_rope_tables(a.rotary_dim or a.head_dim, a.rope_theta, a.rope_scaling,
                                                  self.max_model_len, a.max_position_embeddings)
        self.cos, self.sin = self.rope.cos.to(self.device), self.rope.sin.to(self.device)
        # Each backend lays out its blocks as its kernels read them best.
        shape = self.kernels.attention.cache_shape(self.num_kv_blocks, config.block_size, self.args.num_kv_heads,
                                                   self.args.head_dim, self.kv_cache_dtype)
        # Zeroed so padded block slots read by batched kernels are finite.
        self.kv_caches = [(self._zeroed_cache(shape), self._zeroed_cache(shape))
                          for _ in range(self.layers.end - self.layers.first)]
        if not config.fused_decoder:
            why = "fused_decoder=false"
        else:
            why = self.model.prepare_decoder_stack(self.kv_caches)
        self.decoder_layers = "one C++ call" if why is None else f"Python ({why})"
        log.info("splitfuse: decoder layers in %s", self.decoder_layers)
        if group is not None:
            group.barrier()  # every rank has its shard and cache

    def _attach_lora(self) -> None:
        """Read the configured LoRA adapters and hook the projections they adapt (before the
        kernels are prepared: a hooked gate_up projection leaves its activation out)."""
        self.lora: LoraRegistry | None = None
        self.lora_state: LoraState | None = None
        self._acquired: dict[str, LoraAdapter] = {}  # by acquire_adapters, for the next forward pass
        adapters = self.config.lora_adapters()
        runtime = bool(self.config.lora_load_dir)
        if not adapters and not runtime:
            return
        a = self.args
        base = BaseShape(num_layers=a.num_layers, hidden_size=a.hidden_size, q_size=a.num_heads * a.head_dim,
                         kv_size=a.num_kv_heads * a.head_dim, intermediate_size=a.intermediate_size,
                         moe=a.num_experts > 0)
        backend = self.linear_backend
        self.lora = LoraRegistry(adapters, base, self.config.max_loras, self.config.max_lora_rank, self.dtype,
                                 self.device, make_kernel=lambda weight: make_linear_kernel(weight, None, backend),
                                 runtime=runtime, layers=range(self.layers.first, self.layers.end))
        # Where the Triton-lang kernels run, LoRA takes its Triton-lang kernel too (one per part).
        state = self.lora_state = LoraState(self.lora.stacks, device_kernel=self.kernels.triton_lang)
        self.model.attach_lora(state, lambda layer, name: LoraProjection(layer, name, state),
                               {TARGETS[t][0] for t in self.lora.targets})

    def _zeroed_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            # On transparent huge pages: a step reads its sequences' blocks scattered over the pool,
            # and on 4 KiB pages nearly every K/V tile read costs a TLB miss (fp32, 32 decodes of
            # ~700 tokens: attention 13.5-15.3 -> 12.1-13.3 ms per step). At start, zeroing 1 GiB this
            # way took 0.12 s against torch.zeros' 0.21 s, or 1.4 s when the kernel had to compact
            # memory for the first huge pages.
            return huge_page_empty(shape, self.kv_cache_dtype).zero_()
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    def weight_memory_summary(self) -> str:
        """Weights held, in MB per dtype, e.g. "int8 18.9 MB + float32 17.2 MB"."""
        memory = sorted(self.model.weight_memory().items(), key=lambda item: -item[1])
        return " + ".join(f"{dtype} {nbytes / 1e6:.1f} MB" for dtype, nbytes in memory if nbytes)

    def kv_bytes_per_block(self) -> int:
        """K and V bytes of one block over all layers, as the backend lays it out (an int8 cache's
        scales included)."""
        a = self.args
        itemsize = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        shape = self.kernels.attention.cache_shape(1, self.config.block_size, a.num_kv_heads, a.head_dim,
                                                   self.kv_cache_dtype)
        return 2 * self._kv_layers * math.prod(shape) * itemsize

    def _size_kv_cache(self) -> None:
        self.num_kv_blocks = self._num_kv_blocks()
        self.max_model_len = self._fit_max_model_len()

    def _kv_cache_bytes(self) -> int:
        """kv_cache_memory_gb in bytes; for auto, from the memory bound and the weights just loaded."""
        config = self.config
        if config.kv_cache_memory_gb != "auto":
            return int(float(config.kv_cache_memory_gb) * (1 << 30))
        bound = memory_bound()
        weights = sum(self.model.weight_memory().values())
        kv = auto_kv_cache_bytes(bound.bytes, weights, config.kv_cache_replicas)
        log.info("splitfuse: kv_cache_memory_gb=auto -> %.3g GiB: %.0f%% of %s %.3g GiB after %d replica(s) of "
                 "%.3g GiB of weights, divided by %d", kv / (1 << 30), AUTO_KV_SHARE * 100, bound.source,
                 bound.bytes / (1 << 30), config.kv_cache_replicas, weights / (1 << 30), config.kv_cache_replicas)
        return kv

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        blocks = self._kv_cache_bytes() // self.kv_bytes_per_block()
        # More blocks than max_num_seqs full-length sequences can ever use (beside the admission
        # watermark) would only waste memory.
        cap = pool_blocks_for(self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size),
                              self.config.kv_watermark)
        return max(1, min(blocks, cap))

    def _fit_max_model_len(self) -> int:
        """max_model_len, lowered to what the KV pool can hold for one sequence when it came from
        the checkpoint; an explicit max_model_len the pool cannot hold is refused with the
        setting to raise. Logs the pool's capacity either way."""
        config, bs = self.config, self.config.block_size
        gib_per_block = self.kv_bytes_per_block() / (1 << 30)
        fits = longest_sequence(self.num_kv_blocks, bs, config.kv_watermark)
        wanted = self.max_model_len
        if wanted > fits:
            blocks = pool_blocks_for(-(-wanted // bs), config.kv_watermark)
            raise_what = (f"num_kv_blocks to {blocks}" if config.num_kv_blocks is not None
                          else f"kv_cache_memory_gb to {blocks * gib_per_block:.3g}")
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len={wanted} does not fit the KV cache: its {self.num_kv_blocks} blocks "
                                 f"of {bs} tokens hold one sequence of at most {fits} tokens. Raise {raise_what}, "
                                 f"or lower max_model_len")
            log.warning("splitfuse: max_model_len lowered from the checkpoint's %d to %d, the longest sequence the "
                        "KV cache holds; raise %s to serve the full context", wanted, fits, raise_what)
            wanted = fits
        log.info("splitfuse: KV cache: %d blocks of %d tokens = %d tokens (%.3g GiB); %d sequences of "
                 "max_model_len %d fit at once", self.num_kv_blocks, bs, self.num_kv_blocks * bs,
                 self.num_kv_blocks * gib_per_block, self.num_kv_blocks // -(-wanted // bs), wanted)
        return wanted

    def check(self) -> None:
        """Raise the group's failure, if the ranks have failed (a step can no longer run)."""
        if self.leader is not None:
            self.leader.check()

    def execute(self, batch: RaggedBatch | MicroBatches) -> torch.Tensor | list[SampledToken | Exception]:
        """Run the model over the batch: `launch`, then `collect`."""
        self.launch(batch)
        return self.collect()

    @torch.inference_mode()
    def launch(self, batch: RaggedBatch | MicroBatches) -> None:
        """Start the forward pass over the batch. With tensor or pipeline parallelism the other
        ranks get the batch first and run their parts. With pipeline stages (the batch may come
        cut into micro-batches) rank 0 runs the first stage's part and goes on while the later
        stages run theirs: several batches may be in flight, collected in launch order."""
        if self.leader is not None:
            self.leader.run_step(self._launch, batch, wait=self.pipe is None)
        else:
            self._launch(batch)

    def _launch(self, batch: RaggedBatch | MicroBatches) -> None:
        if self.layers.has_head:
            self._launched.append((batch, self._head(self.forward_hidden(batch), batch), 0))
            return
        self.pipe.step += 1
        for part in batch.parts if isinstance(batch, MicroBatches) else [batch]:
            self.forward_hidden(part)  # each sent on as it is done
        self._launched.append((batch, None, self.pipe.step))

    @torch.inference_mode()
    def collect(self) -> torch.Tensor | list[SampledToken | Exception]:
        """The oldest launched batch's result: float32 logits of its sampling rows [S, V]; with
        pipeline stages, the tokens the last stage sampled for them (stage_sampling.py), micro-batch
        by micro-batch (sampling rows in step order)."""
        batch, logits, step = self._launched.popleft()
        if logits is not None:
            return logits
        return self.leader.guard(lambda: self._collect_sampled(batch, step))

    def _collect_sampled(self, batch: RaggedBatch | MicroBatches, step: int) -> list[SampledToken | Exception]:
        last_stage = self.pipe.num_stages - 1
        sampled = [row for part in (batch.parts if isinstance(batch, MicroBatches) else [batch])
                   for row in part.sampling.decode(
                       self.pipe.recv_sampled(part.sampling.num_rows, part.sampling.reply_width, self.device),
                       last_stage)]
        self.pipe.flush(through=step)
        return sampled

    def _head(self, hidden: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        """The logits of the sampling rows; embedding rows are pooled instead, not sampled: kept
        (float32) for the engine (one stage only: pipelines refuse embedding requests)."""
        self.pooled_hidden = None
        if batch.pool_rows is not None:
            self.pooled_hidden = hidden.index_select(0, batch.pool_rows).float()
            hidden = hidden.index_select(0, batch.logit_rows)
            if hidden.shape[0] == 0:
                return torch.empty((0, self.args.vocab_size), dtype=torch.float32, device=hidden.device)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def run_stage(self, batch: RaggedBatch | MicroBatches) -> None:
        """What ranks 1..N-1 run each step: their part of the forward pass, micro-batch by
        micro-batch; the last pipeline stage's first tensor-parallel rank samples each
        micro-batch's rows and sends the tokens back to rank 0. A step's sends are waited for two
        steps later: the next stage (or rank 0) may still be busy with the step before."""
        if self.pipe is not None:
            self.pipe.step += 1
            self.pipe.flush(through=self.pipe.step - 2)
        for part in batch.parts if isinstance(batch, MicroBatches) else [batch]:
            hidden = self.forward_hidden(part)
            if self.pipe is not None and self.layers.has_head and self.group.tp_rank == 0 and part.sampling.num_rows:
                logits = self.model.compute_logits(hidden).float()
                self.pipe.send_sampled(part.sampling.sample(self._stage_sampler(part.sampling), logits))

    def _stage_sampler(self, sampling: StageSampling) -> Sampler:
        """The last stage's sampler, one for the engine's life (its unseeded rows' generator goes on
        from step to step, as rank 0's does without stages)."""
        if self.sampler is None:
            self.sampler = Sampler(sampling.eos_token_ids, self.config.seed)
        return self.sampler

    @torch.inference_mode()
    def forward_hidden(self, batch: RaggedBatch) -> torch.Tensor:
        """Hidden states of the sample rows (tensor parallelism: every rank runs it, only rank 0
        computes logits). The last layer writes every row's K/V and computes nothing else for
        the rest. A pipeline stage takes its input from the previous stage and, before the last,
        sends its output (every row's) to the next."""
        attention, kv_heads = self.kernels.attention, self.args.num_kv_heads
        attention.prepare(batch.attn, batch.query_lens, batch.seq_lens, kv_heads)
        if self.lora_state is not None:
            adapters = self._step_adapters(batch.lora.names if batch.lora is not None else [])
            self.lora_state.set_step(adapters, [self.lora.slot(a.name) for a in adapters], batch.lora, self.device)
        elif batch.lora is not None:
            raise ValueError(f"LoRA adapters {batch.lora.names} requested but this model serves none")
        keep = None
        if (last := batch.last_layer) is not None and self.layers.has_head:
            attention.prepare(last.attn, last.query_lens, last.seq_lens, kv_heads)
            keep = (batch.sample_rows, last.attn)
        hidden = None
        if not self.layers.has_embedding:
            hidden = self.pipe.recv_hidden(batch.num_tokens, self.args.hidden_size, self.dtype, self.device)
        out = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches, self.cos, self.sin, keep=keep,
                         hidden=hidden)
        if not self.layers.has_head:
            self.pipe.send_hidden(out)
        return out

    def kv_fingerprint(self) -> KVFingerprint:
        """What this runner's KV blocks depend on besides their tokens (kv_tiers/fingerprint.py)."""
        a, name = self.args, lambda dtype: str(dtype).removeprefix("torch.")
        return KVFingerprint(architecture=a.architecture, num_layers=a.num_layers, num_kv_heads=a.num_kv_heads,
                             head_dim=a.head_dim, block_size=self.config.block_size,
                             kv_dtype=name(self.kv_cache_dtype), block_shape=tuple(self.kv_caches[0][0].shape[1:]),
                             numerics=f"{name(self.dtype)} {self.quantization} {self.linear_backend}",
                             weights=model_files_identity(self.config.model))

    @torch.inference_mode()
    def read_kv_blocks(self, block_ids: list[int], fingerprint: bytes) -> list[bytes]:
        """The KV of blocks `block_ids` over every layer, each encoded (kv_tiers/block_codec.py)."""
        return block_codec.read_blocks(self.kv_caches, block_ids, fingerprint)

    @torch.inference_mode()
    def write_kv_blocks(self, block_ids: list[int], payloads: list[memoryview]) -> None:
        """Copy blocks' KV (decoded payloads of `read_kv_blocks`) into blocks `block_ids`."""
        block_codec.write_blocks(self.kv_caches, block_ids, payloads)

    def acquire_adapters(self, names: list[str]) -> dict[str, Exception]:
        """Make the next step's LoRA adapters resident, each on its own: one that cannot be read
        again (its folder changed or vanished since the start) is returned with its error, the
        others stay. The next forward pass takes them from here instead of acquiring them again."""
        acquired: dict[str, LoraAdapter] = {}
        errors: dict[str, Exception] = {}
        for name in names:  # one by one: the ones loaded stay the most recently used, never evicted here
            try:
                acquired[name] = self.lora.acquire([name])[0]
            except (ValueError, OSError) as e:
                errors[name] = e
        self._acquired = acquired
        return errors

    def _step_adapters(self, names: list[str]) -> list[LoraAdapter]:
        """The adapters `names` for this forward pass: those `acquire_adapters` made resident for
        it, or, for a caller that ran the batch without it (a runner driven directly), acquired here."""
        acquired, self._acquired = self._acquired, {}  # for one pass only: a later acquire may evict
        if all(name in acquired for name in names):
            return [acquired[name] for name in names]
        return self.lora.acquire(names)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0); nothing to do otherwise."""
        if self.leader is not None:
            self.leader.shutdown()

"""EngineConfig (every engine knob) and ServerConfig (how a served replica admits and answers
requests), each validated once.

The Triton model's `config.pbtxt` `parameters` map one to one onto the fields of the two (same
names; `split_parameters`), and `LLM(model, **kwargs)` takes EngineConfig's names as keywords.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from splitfuse.config_parsing import _FromStrings, _check_choice, _check_non_negative, _check_positive
from splitfuse.kv_events.endpoint import check_endpoint, replica_endpoint
from splitfuse.kv_events.events import ENCODINGS as KV_EVENT_ENCODINGS
from splitfuse.server_config import ServerConfig  # its own module; imported from here as ever

SCHEDULER_POLICIES = ("splitfuse", "prefill_first", "orca")
PROMPT_ORDERS = ("arrival", "deadline", "goodput")
EMBEDDING_POOLINGS = ("last", "mean")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton", "flash_attn")
LINEAR_BACKENDS = ("auto", "cpu", "onednn", "torch")
GGUF_QUANTIZATIONS = ("gguf", "gguf-exact")  # the blocks of the GGUF file a checkpoint came from
LOAD_QUANTIZATIONS = ("q4_0", "q4_1", "q8_0")  # any float checkpoint quantized into GGUF blocks at load
# Those run the GGUF block kernel (float32 activations, whole rows: no tensor parallelism).
BLOCK_QUANTIZATIONS = GGUF_QUANTIZATIONS + LOAD_QUANTIZATIONS
QUANTIZATIONS = ("auto", "none", "int8") + BLOCK_QUANTIZATIONS
SPECULATIVE_METHODS = ("none", "ngram", "draft")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
TENSOR_PARALLEL_LAUNCHES = ("spawn", "env")
LORA_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on structured-output work, in the units the code uses; EngineConfig's
    guide_compile_timeout_s, grammar_cache_mb, max_pending_guides and grammar_step_budget_ms."""

    compile_timeout_s: float = 30.0  # the 49k-token built-in JSON grammar compiles in ~5 ms
    cache_bytes: int = 512 << 20
    max_pending: int = 16
    step_budget_s: float = 1.0


@dataclass
class EngineConfig(_FromStrings):
    model: str
    """Local Hugging Face checkpoint directory (config.json + *.safetensors)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `model`."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    token_budget: int = 512
    """Tokens per forward pass (Dynamic SplitFuse's fixed budget)."""
    max_num_seqs: int = 256
    """Most sequences resident (running) at once."""
    num_kv_blocks: int | None = None
    """KV pool size in blocks; when unset it is derived from `kv_cache_memory_gb`."""
    kv_cache_memory_gb: float | str = 1.0
    """KV pool size in GiB, used when `num_kv_blocks` is unset; "auto": 70% of the memory this
    process may use (its cgroup's limit, else MemAvailable) left after the weights of
    `kv_cache_replicas` replicas, divided among them (utils/memory_budget.py)."""
    kv_cache_replicas: int = 1
    """Engine replicas on this host that share its memory, for kv_cache_memory_gb=auto (the
    launcher sets it to --instances)."""
    max_model_len: int | None = None
    """Longest prompt + generation; defaults to the model's max_position_embeddings."""
    dtype: str = "auto"
    """float32 | bfloat16 | float16 | auto (the checkpoint's dtype on GPUs; on CPUs bfloat16 for a
    bfloat16 checkpoint where bf16 runs at least as fast as float32: AVX-512 BF16 or AMX, or the
    C++ kernels' AVX2 build widening bf16 weights in registers; else float32)."""
    kv_cache_dtype: str = "auto"
    """auto | bfloat16 | int8: the KV cache's element type (auto: the model's dtype). bfloat16
    under a float32 model halves the cache's memory (twice the blocks for `kv_cache_memory_gb`)
    and the bytes decode attention reads; K/V are rounded to bf16 as they are stored, so outputs
    can differ from float32's. int8 (float32 or bfloat16 models) stores K and V as int8 codes with
    a float32 scale per token and kv head: head_dim + 4 bytes per token, head and K or V, about
    half of bf16's (1.88x the blocks at head_dim 64), at a small accuracy cost. Both need the C++
    CPU attention (attention_backend cpu)."""
    attention_backend: str = "auto"
    """auto | cpu | torch | triton | flash_attn (auto: flash_attn or triton on GPUs; on CPUs the
    C++ `cpu` kernels when they build on the machine, else torch)."""
    linear_backend: str = "auto"
    """auto | cpu | onednn | torch: how projections multiply. cpu: the C++ kernel over weights
    packed at load into column blocks; onednn: oneDNN with weights packed at load; torch:
    F.linear. auto: cpu on AVX-512 CPUs without AMX (bf16 also needs AVX-512 BF16) and on AVX2
    CPUs for bfloat16 and int8, else oneDNN where torch supports it for the dtype, else F.linear."""
    fused_decoder: bool = True
    """Run a step's decoder layers in one C++ call where every part of them runs the C++ CPU
    kernels (dense models, float32 or bfloat16, float or int8 projections, the KV cache in the
    model's dtype, no tensor parallelism): the same kernels and results without the Python between
    them. false runs them layer by layer in Python."""
    quantization: str = "auto"
    """auto | none | int8 | gguf | gguf-exact | q4_0 | q4_1 | q8_0. auto: gguf for a checkpoint
    converted from a quantized GGUF file where the block kernel runs (CPU, float32, one rank),
    else none (logged with the reason). int8 quantizes the projections' weights at load (per
    output channel) and their activations per token at run time (CPU, oneDNN); the LM head and MoE
    routers stay float. gguf / gguf-exact (a checkpoint converted from a GGUF file, float32, CPU):
    the projections, the LM head and the embedding keep the file's own blocks (Q4_0, Q4_1, Q8_0,
    Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; a mixed file each tensor in its own type) packed in memory at
    about the file's size, never dequantized whole; gguf multiplies them with int8 activations per
    32-k group (llama.cpp's arithmetic, integer dot products), gguf-exact widens them to float32 in
    registers (the dequantized float32 model's results, bit for bit). Other tensors stay float.
    none dequantizes a GGUF file's weights at load. q4_0 / q4_1 / q8_0 (any float checkpoint, run
    in float32, CPU): the projections quantized at load into GGUF's blocks of that kind (32
    weights a block, round to nearest: 4.5 / 5 / 8.5 bits a weight) and run as gguf; the LM head
    and the embedding in Q8_0 blocks."""
    speculative_method: str = "none"
    """none | ngram | draft: propose tokens cheaply and verify them in one pass (speculative
    decoding). ngram looks the sequence's last tokens up earlier in its own text; draft runs
    `speculative_model`, a smaller checkpoint with the same tokenizer."""
    num_speculative_tokens: int = 4
    """Tokens proposed per verification (k): a speculating sequence adds 1 + k tokens to a step."""
    speculative_model: str | None = None
    """Draft checkpoint directory for speculative_method=draft."""
    ngram_min: int = 1
    """Shortest suffix the n-gram proposer looks up."""
    ngram_max: int = 4
    """Longest suffix the n-gram proposer looks up (it tries the longest first)."""
    speculative_disable_batch_size: int = 32
    """No speculation in a step that decodes more sequences than this: a large batch makes the
    pass compute-bound, so verifying proposals would cost about what it saves."""
    scheduler_policy: str = "splitfuse"
    """splitfuse | prefill_first | orca (the last two are benchmark baselines)."""
    prompt_order: str = "arrival"
    """arrival | deadline | goodput: the order prompts are computed in (prompt_order.py). deadline:
    earliest first-token deadline first; goodput: the same, but prompts that can no longer make
    their deadline go after those that can (until they have waited twice their allowance)."""
    first_token_deadline_tokens_per_s: float = 512.0
    """A prompt's first token is due at its arrival plus its length at this rate (DeepSpeed-FastGen's
    SLA uses 512 tokens/s); for prompt_order deadline and goodput."""
    embedding_pooling: str = "last"
    """last | mean: how an embedding request (SamplingParams.embed) pools its prompt's final hidden
    states (after the final norm): the last token's (a causal LM's own summary of the prompt) or the
    mean of all of them (its prompt is then computed whole, never from the prefix cache)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    kv_watermark: float = 0.01
    """Share of KV blocks kept free when admitting new prompts, so decodes can grow."""
    enable_prefix_caching: bool = True
    """Share the KV of full blocks between requests that start with the same tokens (a system
    prompt, earlier chat turns); freed blocks stay cached until their room is needed."""
    kv_events_endpoint: str = ""
    """Publish KV cache events (blocks stored in and removed from the prefix cache, with their
    hashes and tokens) on a ZeroMQ PUB socket bound here, in vLLM's format, for a KV-aware router
    (NVIDIA Dynamo, llm-d) to send each request where its prefix is cached (docs/kv_events.md).
    tcp://127.0.0.1:PORT, ipc://PATH or inproc://NAME; "" = off. Replica i binds PORT + i (an ipc
    path or inproc name gets "-i"). A non-loopback address needs kv_events_allow_remote."""
    kv_events_topic: str = ""
    """The topic frame of every KV event message (subscribers filter on its prefix)."""
    kv_events_max_queue: int = 1000
    """Step batches of KV events waiting for the publisher's thread; when full, the oldest is
    dropped (counted in splitfuse_kv_event_batches_dropped_total): a step never waits on events."""
    kv_events_encoding: str = "array"
    """array | map: each event as a tagged array (vLLM up to 0.23; read by every consumer) or a
    tagged map with named fields (vLLM since 0.24; Dynamo and llm-d read both)."""
    kv_events_allow_remote: bool = False
    """Let kv_events_endpoint bind a non-loopback address (e.g. tcp://*:5557): the events carry
    prompts' token ids, so they stay on this machine unless the operator says otherwise."""
    kv_events_replica: int = 0
    """This engine's index among a server's replicas: its port offset and the data_parallel_rank
    of its event batches. A served replica's is its Triton instance index (set by the stub); set
    it for engines started apart (LLM) that publish on one host."""
    kv_offload_memory_gb: float = 0.0
    """Host-RAM tier of the prefix cache, in GiB; 0 = off. Full KV blocks the pool evicts are
    copied here (the least recently used dropped past the bound, or moved down to the disk tier)
    and copied back instead of recomputed when a later prompt starts with them. Per engine
    process: replicas do not share it. Costs up to that much host memory; pays off when shared
    prefixes (system prompts, chat histories) outgrow the KV pool. Needs enable_prefix_caching."""
    kv_offload_dir: str = ""
    """Disk tier of the prefix cache: a folder, one file per block ("" = off). Blocks leaving the
    host-RAM tier (or evicted from the pool, without one) are written here; shared by every engine
    process that sets the same folder (atomic writes; a fingerprint of the model keeps another
    model's blocks out). Slower than RAM, larger and surviving restarts. Not with LoRA adapters
    (another process may serve other weights under an adapter's name)."""
    kv_offload_disk_gb: float = 4.0
    """Bound of the disk tier in GiB (this model's files in kv_offload_dir); past it the least
    recently used blocks are deleted."""
    num_threads: int = 0
    """OpenMP threads on CPU for torch and the C++ kernels; 0 keeps torch's default (one per core).
    With tensor parallelism this is the total, divided evenly among the ranks."""
    tensor_parallel_size: int = 1
    """Ranks that split each weight (torch.distributed: gloo on CPU, NCCL on CUDA); 1 = off."""
    tensor_parallel_launch: str = "spawn"
    """spawn: the engine starts the other ranks on this machine; env: they are started apart
    (`python -m splitfuse.parallel.worker`, e.g. by torchrun on other machines) and meet at
    MASTER_ADDR:MASTER_PORT with WORLD_SIZE / RANK from the environment (the engine is rank 0)."""
    tensor_parallel_timeout_s: float = 30.0
    """Longest wait on another rank in a step's collective: a rank that died or hangs fails the
    engine within about this long instead of wedging it."""
    pipeline_parallel_size: int = 1
    """Stages, each holding a contiguous range of the layers (on tensor_parallel_size ranks); 1 = off."""
    pipeline_steps_in_flight: int = 0
    """With pipeline_parallel_size > 1: steps in the pipeline at once. Rank 0 schedules and starts
    the next step while the later stages run earlier ones (a sequence waits for its last token
    before its next step). 0 = pipeline_parallel_size; 1 = one step at a time."""
    seed: int = 0
    """Seed for requests that give none."""
    guide_compile_timeout_s: float = GrammarLimits.compile_timeout_s
    """Longest one guide (structured output) may compile; past it the compiler process is killed
    and restarted, and the request fails naming this parameter."""
    grammar_cache_mb: float = GrammarLimits.cache_bytes / (1 << 20)
    """Budget (MiB) of compiled grammars kept for reuse, least recently used evicted first."""
    max_pending_guides: int = GrammarLimits.max_pending
    """Most distinct guides waiting for the (one, per replica) grammar compiler; past it a request
    with a new guide is refused at once as busy."""
    grammar_step_budget_ms: float = GrammarLimits.step_budget_s * 1e3
    """Longest one constrained request's grammar work (masks, checks) may take in one step; past
    it that request ends alone with an error naming this parameter."""
    lora_modules: str = ""
    """LoRA adapters served over the base model: "name=path[,name=path...]", each path a PEFT
    folder (adapter_config.json + adapter_model.safetensors), all read and checked at start. A
    request picks one by name (SamplingParams.lora_name); one step batches several adapters and
    the base. Names: 1-64 of A-Z a-z 0-9 . _ -, unique. Not with tensor_parallel_size > 1 or
    speculative_method=draft; with pipeline_parallel_size > 1 each stage keeps its own layers'
    weights."""
    max_loras: int = 4
    """Adapters resident (weights in memory) at once; with more configured, the least recently
    used one is dropped and read again from its folder when a request needs it. Running
    sequences together use at most this many adapters: a request for another one waits."""
    max_lora_rank: int = 64
    """Largest LoRA rank accepted; an adapter of a higher rank is refused at start."""
    lora_load_dir: str = ""
    """A folder under which adapters may be loaded and unloaded at run time (load_lora /
    unload_lora; the OpenAI front's /v1/load_lora_adapter); empty: no run-time loading (safe by
    default: a client cannot make the server read a file). Set, the adapter stacks are sized once
    at start for max_loras adapters of max_lora_rank on every projection, and configured plus
    loaded adapters together are at most max_loras. Not with pipeline_parallel_size > 1."""

    def __post_init__(self) -> None:
        self.model = os.fspath(self.model)
        if self.tokenizer is None:
            self.tokenizer = self.model
        self.tokenizer = os.fspath(self.tokenizer)
        _check_positive("block_size", self.block_size)
        _check_positive("token_budget", self.token_budget)
        _check_positive("max_num_seqs", self.max_num_seqs)
        if self.num_kv_blocks is not None:
            _check_positive("num_kv_blocks", self.num_kv_blocks)
        self._check_kv_cache_memory()
        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("linear_backend", self.linear_backend, LINEAR_BACKENDS)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("scheduler_policy", self.scheduler_policy, SCHEDULER_POLICIES)
        if self.quantization in BLOCK_QUANTIZATIONS:
            # The packed blocks are whole rows of the file's tensors (not sharded: a pipeline
            # stage keeps its layers' rows whole) multiplying float32 activations.
            if self.tensor_parallel_size > 1:
                raise ValueError(f"quantization={self.quantization!r} cannot run with tensor_parallel_size > 1")
            if self.dtype not in ("auto", "float32"):
                raise ValueError(f"quantization={self.quantization!r} runs float32 activations: dtype must be auto or "
                                 f"float32, got {self.dtype!r}")
        self._check_speculation()
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if not isinstance(self.fused_decoder, bool):
            raise ValueError(f"fused_decoder must be true or false, got {self.fused_decoder!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        self._check_kv_events()
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        _check_choice("prompt_order", self.prompt_order, PROMPT_ORDERS)
        _check_choice("embedding_pooling", self.embedding_pooling, EMBEDDING_POOLINGS)
        rate = self.first_token_deadline_tokens_per_s
        if not (isinstance(rate, (int, float)) and 0.0 < rate < float("inf")):
            raise ValueError(f"first_token_deadline_tokens_per_s must be a finite number > 0, got {rate!r}")
        if self.prompt_order == "goodput" and self.scheduler_policy != "splitfuse":
            raise ValueError("prompt_order=goodput needs scheduler_policy=splitfuse (it shares each step's budget)")
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        _check_choice("tensor_parallel_launch", self.tensor_parallel_launch, TENSOR_PARALLEL_LAUNCHES)
        if not (isinstance(self.tensor_parallel_timeout_s, (int, float)) and 0 < self.tensor_parallel_timeout_s < 1e6):
            raise ValueError(f"tensor_parallel_timeout_s must be a number of seconds > 0, got "
                             f"{self.tensor_parallel_timeout_s!r}")
        _check_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if not (isinstance(self.pipeline_steps_in_flight, int) and 0 <= self.pipeline_steps_in_flight <= 64):
            raise ValueError(f"pipeline_steps_in_flight must be an integer in [0, 64], got "
                             f"{self.pipeline_steps_in_flight!r}")
        _check_positive("max_pending_guides", self.max_pending_guides)
        for name in ("guide_compile_timeout_s", "grammar_cache_mb", "grammar_step_budget_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e9):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self._check_lora()
        self._check_kv_offload()

    def _check_kv_cache_memory(self) -> None:
        gb = self.kv_cache_memory_gb
        _check_positive("kv_cache_replicas", self.kv_cache_replicas)
        if gb == "auto":
            # Both size a second pool or shard before this replica's weights are measured.
            if self.tensor_parallel_size * self.pipeline_parallel_size > 1 or self.speculative_method == "draft":
                raise ValueError("kv_cache_memory_gb=auto cannot be combined with tensor_parallel_size or pipeline_"
                                 "parallel_size > 1 or speculative_method=draft; give kv_cache_memory_gb in GiB")
        elif isinstance(gb, str) or isinstance(gb, bool) or not gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be a number of GiB > 0 or auto, got {gb!r}")

    def _check_kv_events(self) -> None:
        if not isinstance(self.kv_events_allow_remote, bool):
            raise ValueError(f"kv_events_allow_remote must be true or false, got {self.kv_events_allow_remote!r}")
        check_endpoint(self.kv_events_endpoint, self.kv_events_allow_remote)
        if not isinstance(self.kv_events_replica, int) or isinstance(self.kv_events_replica, bool) \
                or self.kv_events_replica < 0:
            raise ValueError(f"kv_events_replica must be an integer >= 0, got {self.kv_events_replica!r}")
        replica_endpoint(self.kv_events_endpoint, self.kv_events_replica)  # the port it moves to exists
        _check_positive("kv_events_max_queue", self.kv_events_max_queue)
        _check_choice("kv_events_encoding", self.kv_events_encoding, KV_EVENT_ENCODINGS)
        if not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic must be a string, got {self.kv_events_topic!r}")

    def _check_lora(self) -> None:
        _check_positive("max_loras", self.max_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        adapters = self.lora_adapters()  # raises naming lora_modules
        if not isinstance(self.lora_load_dir, str):
            raise ValueError(f"lora_load_dir must be a folder's path, got {self.lora_load_dir!r}")
        if self.lora_load_dir and not os.path.isdir(self.lora_load_dir):
            raise ValueError(f"lora_load_dir: {self.lora_load_dir!r} is not a folder")
        if self.lora_load_dir and len(adapters) >= self.max_loras:
            raise ValueError(f"lora_load_dir: lora_modules already names max_loras={self.max_loras} adapters, "
                             "none could be loaded at run time; raise max_loras")
        what = "lora_modules" if adapters else "lora_load_dir"
        if (adapters or self.lora_load_dir) and self.tensor_parallel_size > 1:
            raise ValueError(f"{what} cannot be combined with tensor_parallel_size > 1 (adapters are not "
                             "sharded across ranks)")
        if self.lora_load_dir and self.pipeline_parallel_size > 1:
            raise ValueError("lora_load_dir cannot be combined with pipeline_parallel_size > 1 (an adapter loaded at "
                             "run time would reach rank 0's stage only); name the adapters in lora_modules")
        if (adapters or self.lora_load_dir) and self.speculative_method == "draft":
            raise ValueError(f"{what} cannot be combined with speculative_method=draft (the draft model has "
                             "no adapters); use speculative_method=ngram or none")

    def _check_kv_offload(self) -> None:
        _check_non_negative("kv_offload_memory_gb", self.kv_offload_memory_gb)
        _check_non_negative("kv_offload_disk_gb", self.kv_offload_disk_gb)
        if not isinstance(self.kv_offload_dir, str):
            raise ValueError(f"kv_offload_dir must be a folder's path, got {self.kv_offload_dir!r}")
        if not self.kv_offload_tiers:
            return
        what = "kv_offload_memory_gb" if self.kv_offload_memory_gb > 0 else "kv_offload_dir"
        if self.kv_offload_dir and self.kv_offload_disk_gb <= 0:
            raise ValueError("kv_offload_disk_gb must be > 0 with kv_offload_dir set")
        if not self.enable_prefix_caching:
            raise ValueError(f"{what} needs enable_prefix_caching=true (the tiers hold evicted prefix-cache blocks)")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(f"{what} cannot be combined with tensor_parallel_size or pipeline_parallel_size > 1: "
                             "each rank holds only its shard or its stage's layers of a block's KV, which the "
                             "engine (rank 0) cannot copy whole")
        if self.kv_offload_dir and (self.lora_modules or self.lora_load_dir):
            raise ValueError("kv_offload_dir cannot be combined with lora_modules or lora_load_dir: an adapter's "
                             "KV is keyed by its name, and another process sharing the folder (or this one after "
                             "a restart) may serve other weights under that name; use kv_offload_memory_gb alone")

    @property
    def kv_offload_tiers(self) -> bool:
        """Whether a host-RAM or disk tier holds blocks the KV pool evicts."""
        return self.kv_offload_memory_gb > 0 or bool(self.kv_offload_dir)

    def lora_adapters(self) -> dict[str, str]:
        """`lora_modules` parsed: adapter name -> PEFT folder, in the order given."""
        if not isinstance(self.lora_modules, str):
            raise ValueError(f"lora_modules must be a string \"name=path[,name=path...]\", got {self.lora_modules!r}")
        adapters: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in self.lora_modules.split(","))):
            name, sep, path = (s.strip() for s in item.partition("="))
            if not sep or not path:
                raise ValueError(f"lora_modules: {item!r} is not name=path")
            if not LORA_NAME.fullmatch(name):
                raise ValueError(f"lora_modules: adapter name {name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -")
            if name in adapters:
                raise ValueError(f"lora_modules: adapter name {name!r} is given twice")
            adapters[name] = path
        return adapters

    def _check_speculation(self) -> None:
        _check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("ngram_min", self.ngram_min)
        _check_positive("ngram_max", self.ngram_max)
        _check_positive("speculative_disable_batch_size", self.speculative_disable_batch_size)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative_method=draft needs speculative_model (a draft checkpoint directory)")
        if self.speculative_model is not None:
            self.speculative_model = os.fspath(self.speculative_model)


    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(compile_timeout_s=self.guide_compile_timeout_s,
                             cache_bytes=int(self.grammar_cache_mb * (1 << 20)),
                             max_pending=self.max_pending_guides,
                             step_budget_s=self.grammar_step_budget_ms / 1e3)

def parameter_names() -> list[str]:
    """Every name config.pbtxt's `parameters` (and the launcher's --param) may use."""
    return EngineConfig.field_names() + ServerConfig.field_names()


def check_parameter_names(names) -> None:
    """Raise ValueError for names neither config knows (typos in config.pbtxt or --param)."""
    known = parameter_names()
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unknown engine parameter(s) {unknown}; known: {sorted(known)}")


def split_parameters(values: dict[str, str]) -> tuple[EngineConfig, ServerConfig]:
    """config.pbtxt's parameters (string values), each name to the one config that has it."""
    check_parameter_names(values)
    server_names = set(ServerConfig.field_names())
    server = ServerConfig.from_strings({k: v for k, v in values.items() if k in server_names})
    engine = EngineConfig.from_strings({k: v for k, v in values.items() if k not in server_names})
    return engine, server

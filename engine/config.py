"""Engine configuration: the arguments of `Engine(...)`, their parsing, and the KV-pool sizing."""
from __future__ import annotations

import os

from dataclasses import dataclass
from typing import Any

import torch

from compression.config import KVCompressionConfig, coerce
from engine.argspec import setting
from engine.attention import ATTENTION_BACKENDS, cpu_ext, resolve_backend_name
from engine.hub import ModelSource
from engine.models.backends import GEMM_BACKENDS, LAYER_OPS
from engine.models.quant import QUANTIZATIONS
from engine.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES
from engine.structured_params import PARSE_DEPTH, GrammarLimits
from paging.kv_cache import bytes_per_block, num_blocks_for_memory
from paging.kv_format import KV_DTYPE_NAMES, KVFormat, kv_format

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls only beat fp32 on CPUs with AMX or AVX512-BF16; on plain AVX2 they are ~4x slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def parse_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and on CPUs with fast bf16 matmuls, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        on_cuda = device is not None and device.type == "cuda"
        return torch.bfloat16 if on_cuda or cpu_has_fast_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


def parse_memory(value: int | str, plain: int = 1) -> int:
    """Bytes from a size: an int or a numeric string counts in units of ``plain`` (1: bytes; 2**30 for vLLM's GiB
    flags such as ``--swap-space 4``); otherwise a number with a unit: ``512MiB``, ``2GB``, or vLLM's one-letter
    units, decimal in lower case and binary in upper case (``4g`` = 4e9, ``4G`` = 4 GiB)."""
    if isinstance(value, bool):
        raise ValueError(f"memory sizes must be a number or a size like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        nbytes = int(value * plain)
    else:
        text = str(value).strip().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
        unit = text[len(num):]
        if len(unit) == 1 and unit.lower() in "kmgt" and unit.lower() != "b":
            scale = (1024 if unit.isupper() else 1000) ** ("kmgt".index(unit.lower()) + 1)
        elif unit.lower() in _UNITS:
            scale = _UNITS[unit.lower()] if unit else plain
        else:
            scale = None
        try:
            nbytes = int(float(num) * scale) if scale is not None and num else None
        except ValueError:
            nbytes = None
        if nbytes is None:
            raise ValueError(f"memory sizes must be a number or a size like '2GiB', got {value!r}")
    if nbytes <= 0:
        raise ValueError(f"memory sizes must be positive, got {value!r}")
    return nbytes


def parse_gib(value: int | float | str) -> int:
    """Bytes of a vLLM GiB setting (``--swap-space 4``: 4 GiB) that may also carry a unit; 0 turns it off."""
    return 0 if value in (0, "0") else parse_memory(value, plain=2**30)


def parse_length(text: str) -> int:
    """A token count as vLLM's --max-model-len takes it: 4096, 32k (32,000) or 32K (32,768)."""
    t = str(text).strip()
    if t[-1:] in ("k", "K", "m", "M"):
        base = 1000 if t[-1].islower() else 1024
        return int(float(t[:-1]) * base ** ("km".index(t[-1].lower()) + 1))
    return int(t)


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (the flag's own usage error, before anything loads)."""
    import argparse

    try:
        value = parse_length(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _compression_arg(text: str) -> str | dict:
    """--kv-compression: a method name or a JSON object of settings."""
    import argparse
    import json

    text = text.strip()
    if not text.startswith("{"):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"invalid JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("the JSON value must be an object")
    return value


def _choices(registry) -> tuple[str, ...]:
    return tuple(registry.names())


DTYPES = ("auto", *_DTYPES)
KV_CACHE_DTYPES = ("auto", *KV_DTYPE_NAMES)


@dataclass
class EngineConfig:
    """The arguments of `Engine(...)`: each field declares its `kvllm serve` flag (engine/argspec.py), so flags,
    their help and the README's table come from here. vLLM's flag names mean what they mean in vLLM."""
    model: str = setting("smollm2", flag=False, help="the positional MODEL of kvllm serve: 'smollm2', a .gguf file, "
                                                     "a Hugging Face directory or a Hub id")
    # -- where the model comes from (engine/hub.py) ---------------------------------------------------------------
    tokenizer: str | None = setting(None, help="load the tokenizer from this path or Hub id instead of the model's")
    revision: str | None = setting(None, help="Hub branch, tag or commit of the model (default: main)")
    tokenizer_revision: str | None = setting(None, help="Hub branch, tag or commit of the tokenizer")
    download_dir: str | None = setting(None, help="Hugging Face cache folder Hub ids are downloaded into and read "
                                                  "from (default: $HF_HOME/hub)")
    trust_remote_code: bool = setting(False, help="let transformers run a repository's tokenizer/config code (the "
                                                  "model always runs kvllm's own implementation)")
    # -- numerics and devices -----------------------------------------------------------------------------------
    dtype: str | torch.dtype = setting("auto", choices=DTYPES, help="model dtype; auto: bfloat16 on CUDA and on "
                                       "CPUs with AMX/AVX512-BF16, float32 elsewhere (bf16 matmuls are slow there); "
                                       "a .gguf model on a CPU with AVX512-BF16 runs float32 split by row count: GEMMs "
                                       "of few rows on the file's blocks as quantized panels (4-bit <= 12 rows, 8-bit "
                                       "<= 8), larger ones on bfloat16 panels, bfloat16 KV pages; bfloat16 there: "
                                       "bfloat16 weights on the panels and KV pages, float32 activations between the "
                                       "GEMMs; bfloat16 on a CPU without bf16 arithmetic, and float16 on any CPU: "
                                       "the weights kept in that dtype as panels the C++ GEMM widens exactly in its "
                                       "tile, KV pages of that dtype, float32 activations")
    device: str | None = setting(None, help="cpu, cuda or cuda:N (default: cuda when available)")
    seed: int = setting(0, help="seed of requests that give none")
    quantization: str | None = setting(None, choices=_choices(QUANTIZATIONS),
                                       help="weight-only quantization of the linear layers (int8: CPU)")
    attention_backend: str = setting("auto", choices=_choices(ATTENTION_BACKENDS),
                                     help="auto: FlashInfer on CUDA, the C++ paged kernel on CPU, else torch")
    gemm_backend: str = setting("auto", choices=_choices(GEMM_BACKENDS),
                                help="linear layers: cpu = packed float32 panels through the C++ kernel, gguf = a "
                                     "float32 model loaded from a .gguf keeps the file's Q4_0/Q4_1/Q8_0 blocks and "
                                     "the kernel dequantizes them (results equal cpu's, ~3x less weight memory), "
                                     "onednn = bfloat16 weights packed once for oneDNN, torch = F.linear; auto: on an "
                                     "AVX2 CPU gguf for a float32 unquantized model loaded from a .gguf, cpu for any "
                                     "other float32 one; a bfloat16 one on the CPU: bfloat16 panels with float32 "
                                     "activations where the CPU has AVX512-BF16, else cpu's panels holding its "
                                     "bfloat16 weights, widened to float32 in the kernel, as a float16 model's are on "
                                     "any CPU (both with layer_ops and attention auto); onednn where neither runs")
    layer_ops: str = setting("auto", choices=_choices(LAYER_OPS),
                             help="RMSNorm (+ residual), RoPE, SiLU-multiply, the greedy argmax: cpu = C++ ops, "
                                  "fused = those and the layers' GEMMs and attention as one C++ call per forward "
                                  "(same kernels, same results; a float32 model with gemm_backend cpu or gguf and "
                                  "the cpu attention backend), torch = torch ops; auto: fused where it applies, "
                                  "else cpu for a float32 or bfloat16 model on the CPU")
    tensor_parallel_size: int = setting(1, parse=positive, aliases=("-tp",), help="ranks the model is split over (Megatron-style); "
                                        "ranks 1..N-1 run in spawned worker processes")
    enforce_eager: bool = setting(False, help="vLLM's flag; kvllm always runs eagerly (CUDA graphs are not wired), "
                                              "so it changes nothing")
    # -- the KV cache -------------------------------------------------------------------------------------------
    block_size: int = setting(16, parse=positive, help="tokens per KV block")
    num_kv_blocks: int | None = setting(None, parse=positive, aliases=("--num-gpu-blocks-override",),
                                        help="size of the KV pool in blocks (overrides every memory setting)")
    kv_cache_memory: int | str | None = setting(
        None, parse=str, aliases=("--kv-cache-memory-bytes",),
        help="size of the KV pool: bytes or a size (512MiB, 4GiB, 4G); default: $VLLM_CPU_KVCACHE_SPACE GiB on CPU "
             "(vLLM's CPU convention) else 2 GiB, and gpu_memory_utilization on CUDA")
    gpu_memory_utilization: float = setting(0.9, help="CUDA: share of the device's memory the model weights and the "
                                                      "KV pool may take together (vLLM's meaning)")
    kv_cache_dtype: str | torch.dtype = setting("auto", choices=KV_CACHE_DTYPES,
                                                help="dtype of the KV pages (auto: the model's): a float dtype, or "
                                                     "8-bit pages: int8 (per-token, per-head scales; CPU), fp8_e5m2 / "
                                                     "fp8_e4m3 (fp8: e4m3; on CPU with per-token scales, on CUDA "
                                                     "FlashInfer's fp8 pages); attention computes in the model dtype")
    enable_prefix_caching: bool = setting(True, help="reuse the KV blocks of cached prompt prefixes")
    max_model_len: int | None = setting(None, parse=positive, help="longest prompt + output, e.g. 4096 or 32k "
                                                                       "(default: the model's, fitted to the pool)")
    # -- batching and memory pressure (engine/scheduler.py) -------------------------------------------------------
    max_num_seqs: int = setting(64, parse=positive, help="sequences running at once")
    max_num_batched_tokens: int = setting(2048, parse=positive, help="tokens per step (decodes and prefill chunks together)")
    watermark: float = setting(0.01, help="share of the pool kept free when admitting while others run")
    scheduling_policy: str = setting("fcfs", choices=SCHEDULING_POLICIES,
                                     help="fcfs: admit when the first chunk fits; compression-aware: also when the "
                                          "projected peak footprint of all running sequences fits")
    admission_optimism: float = setting(1.0, help="compression-aware: admit while projected blocks <= pool x this")
    projected_output_len: int | None = setting(None, parse=positive, help="compression-aware: project at most this many outputs")
    preemption_mode: str = setting("auto", choices=PREEMPTION_MODES,
                                   help="auto: swap to host memory when copying is cheaper than recomputing")
    compress_before_preempt: bool = setting(True, help="run a compression round on demand before preempting")
    swap_space: int | float | str = setting(
        1, parse=str, help="host memory for swapped KV blocks: GiB as in vLLM (--swap-space 4), or a size (512MiB); "
                           "0: off (vLLM's default is 4)")
    lossless_host_memory: int | float | str = setting(
        1, parse=str, help="host memory for the full KV of lossless requests: GiB, or a size (shares one store "
                           "with swap_space)")
    # -- structured outputs (engine/structured.py): compiled on a worker pool, each constraint bounded first ------
    structured_outputs_compile_threads: int = setting(
        2, parse=positive, help="grammar compiles at once (each on its own thread, off the step and HTTP loops)")
    structured_outputs_compile_timeout: float = setting(
        GrammarLimits.timeout, help="seconds a request waits for its grammar to compile (queue included); past "
                                    "it, a 400 naming the field")
    structured_outputs_max_depth: int = setting(
        GrammarLimits.max_depth, parse=positive, help=f"deepest JSON nesting of a schema (at most {PARSE_DEPTH})")
    structured_outputs_max_properties: int = setting(
        GrammarLimits.max_properties, parse=positive, help="object properties across one schema (tools' parameters "
                                                           "included)")
    structured_outputs_max_enum: int = setting(
        GrammarLimits.max_enum, parse=positive, help="enum/const values across one schema; choices of a choice "
                                                     "constraint")
    structured_outputs_max_length: int = setting(
        GrammarLimits.max_length, parse=positive, help="characters of a regex, a grammar, a schema, or all choices "
                                                       "together")
    structured_outputs_max_rules: int = setting(
        GrammarLimits.max_rules, parse=positive, help="rules of an EBNF grammar")
    # -- KV compression (compression/) --------------------------------------------------------------------------
    kv_compression: Any = setting(
        None, parse=_compression_arg, metavar="METHOD|JSON",
        help="engine-wide KV compression: a method or a JSON object of settings, e.g. '{\"method\": \"kara\", "
             "\"ratio\": 0.3}'; requests override it field by field (default: off)")

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            _positive_int(name, getattr(self, name))
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if not isinstance(self.watermark, (int, float)) or not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("trust_remote_code", "enable_prefix_caching", "compress_before_preempt", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        for name in ("model", "tokenizer", "revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if (value is not None or name == "model") and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        for name, registry in (("attention_backend", ATTENTION_BACKENDS), ("gemm_backend", GEMM_BACKENDS),
                               ("layer_ops", LAYER_OPS)):
            registry.get(getattr(self, name))  # a ValueError naming the setting and its choices
        if self.quantization is not None:
            QUANTIZATIONS.get(self.quantization)
        if self.gemm_backend in ("cpu", "gguf", "onednn") and self.quantization is not None:
            raise ValueError(f"gemm_backend={self.gemm_backend!r} packs the model's own weights; "
                             f"quantization={self.quantization!r} brings its own kernel (use gemm_backend 'auto')")
        for name in ("swap_space", "lossless_host_memory"):
            parse_gib(getattr(self, name))  # a clear error now
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        if self.kv_cache_dtype != "auto" and not (
                self.kv_cache_dtype in _DTYPES.values() if isinstance(self.kv_cache_dtype, torch.dtype)
                else self.kv_cache_dtype in KV_DTYPE_NAMES):
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_DTYPE_NAMES)}, got "
                             f"{self.kv_cache_dtype!r}")
        _positive_int("structured_outputs_compile_threads", self.structured_outputs_compile_threads)
        self.grammar_limits()  # a ValueError naming the setting now
        # resolved once: every request's own setting is merged over this typed config (compression/config.py)
        self.kv_compression = coerce(self.kv_compression) or KVCompressionConfig("none")

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(max_depth=self.structured_outputs_max_depth,
                             max_properties=self.structured_outputs_max_properties,
                             max_enum=self.structured_outputs_max_enum, max_length=self.structured_outputs_max_length,
                             max_rules=self.structured_outputs_max_rules,
                             timeout=self.structured_outputs_compile_timeout)

    def ignored_settings(self) -> list[str]:
        """vLLM settings given that mean nothing here (one startup warning each)."""
        out = ["enforce_eager: kvllm always runs eagerly (CUDA graphs are not wired)"] if self.enforce_eager else []
        if self.gpu_memory_utilization != 0.9 and self.resolve_device().type != "cuda":
            out.append("gpu_memory_utilization: it sizes the KV pool on CUDA only; on CPU the pool is "
                       "$VLLM_CPU_KVCACHE_SPACE GiB (vLLM's CPU convention) or --kv-cache-memory")
        return out

    def model_source(self) -> ModelSource:
        """The model, its tokenizer and where their files come from (Hub ids are resolved by `ModelSource.resolve`)."""
        return ModelSource(self.model, self.tokenizer, self.revision, self.tokenizer_revision, self.download_dir,
                           self.trust_remote_code)

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype, device: torch.device) -> KVFormat:
        """The KV pages' format (paging/kv_format.py). Attention, compression scorers and sampling still compute in
        the model dtype: fewer bytes per cached token means fewer bytes a decode step reads (what bounds CPU decode at
        long contexts) and more blocks in a memory budget. A float dtype other than the model's is CPU only; 8-bit
        pages carry a scale per row except under FlashInfer (fp8 only, read with scale 1). What the backend cannot
        run is an error naming the flag, never a silent fallback."""
        backend = resolve_backend_name(self.attention_backend, device)
        fmt = kv_format(self.kv_cache_dtype, model_dtype, row_scales=backend != "flashinfer")
        if fmt.storage != model_dtype and device.type != "cpu" and not fmt.is_8bit:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} differs from the model dtype; on "
                             f"{device.type} use 'auto' or an 8-bit format")
        if backend == "cpu" and fmt.is_8bit and fmt.storage != torch.int8 and not cpu_ext.converts_fp8_in_hardware():
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: this CPU has no F16C/AVX2, which the attention "
                             "kernel's fp8 conversion needs; use --kv-cache-dtype int8 (any CPU)")
        return fmt

    def resolve_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def resolve_max_model_len(self, limit: int) -> int:
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int)
                                               or not 1 <= self.max_model_len <= limit):
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {self.max_model_len!r}")
        return self.max_model_len or limit

    def resolve_num_blocks(self, model_config, dtype: torch.dtype, device: torch.device,
                           num_kv_heads: int | None = None) -> int:
        """KV blocks this process can hold. Under tensor parallelism each rank stores only its `num_kv_heads`, and
        `kv_cache_memory` (and the CPU default, 2 GiB) is for the whole engine, split evenly over the ranks: an even
        head split then gives every tensor-parallel size the same number of blocks. On CUDA each rank's pool takes
        what is free within gpu_memory_utilization of its device."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        c = model_config
        heads = c.num_kv_heads if num_kv_heads is None else num_kv_heads
        if self.kv_cache_memory is not None:
            budget = parse_memory(self.kv_cache_memory) // self.tensor_parallel_size
        elif device.type == "cuda":  # vLLM's rule: weights and KV pool together within this share of the device
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - (1 - self.gpu_memory_utilization) * total)
        else:  # vLLM's CPU backend sizes its pool with VLLM_CPU_KVCACHE_SPACE (GiB)
            budget = parse_gib(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 2) // self.tensor_parallel_size
        n = num_blocks_for_memory(budget, c.num_layers, self.block_size, heads, c.head_dim, dtype)
        if n < 1:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r} is smaller than one KV block "
                             f"({bytes_per_block(c.num_layers, self.block_size, heads, c.head_dim, dtype)} "
                             f"bytes)")
        return n

    def host_blocks(self, model_config, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
        """Blocks of the host store: swap space plus the lossless full tier (one pool, one tensor), of this rank's KV
        heads. Both are host memory for the whole engine, split evenly over the tensor-parallel ranks."""
        nbytes = parse_gib(self.swap_space) + parse_gib(self.lossless_host_memory)
        c = model_config
        heads = c.num_kv_heads if num_kv_heads is None else num_kv_heads
        return num_blocks_for_memory(nbytes // self.tensor_parallel_size, c.num_layers, self.block_size, heads,
                                     c.head_dim, dtype)

    def fit_max_model_len(self, max_model_len: int, num_blocks: int) -> int:
        """One request must always fit the pool, or it would preempt itself forever."""
        kv_tokens = num_blocks * self.block_size
        if kv_tokens >= max_model_len:
            return max_model_len
        if self.max_model_len is not None:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the KV cache ({kv_tokens} "
                             f"tokens); raise num_kv_blocks / kv_cache_memory or lower max_model_len")
        return kv_tokens

"""Engine configuration: the arguments of `Engine(...)`, their parsing, and the KV-pool sizing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.hub import ModelSource
from paging.kv_cache import bytes_per_block, num_blocks_for_memory

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


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as '512MiB' or '2GB'."""
    if isinstance(value, int):
        nbytes = value
    else:
        text = str(value).strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        if unit not in _UNITS or not num:
            raise ValueError(f"memory sizes must be bytes or a size like '2GiB', got {value!r}")
        nbytes = int(float(num) * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"memory sizes must be positive, got {value!r}")
    return nbytes


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


GEMM_BACKENDS = ("auto", "cpu", "torch")


@dataclass
class EngineConfig:
    model: str = "smollm2"
    dtype: str | torch.dtype = "auto"
    device: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_compression: Any = None
    attention_backend: str = "auto"
    gemm_backend: str = "auto"  # linear layers: "cpu" (packed float32 panels, C++), "torch", or "auto"
    layer_ops: str = "auto"  # RMSNorm + residual, RoPE, SiLU-multiply: "cpu" (C++, float32), "torch", or "auto"
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    seed: int = 0
    quantization: str | None = None  # "int8": weight-only int8 linear layers (CPU)
    kv_cache_dtype: str | torch.dtype = "auto"  # dtype the KV pages are stored in ("auto": the model dtype)
    # memory pressure (engine/scheduler.py)
    scheduling_policy: str = "fcfs"
    admission_optimism: float = 1.0
    projected_output_len: int | None = None
    preemption_mode: str = "auto"
    compress_before_preempt: bool = True
    swap_space: int | str = "1GiB"  # host memory for swapped-out KV blocks (0: recompute only)
    lossless_host_memory: int | str = "1GiB"  # host memory for lossless sequences' full KV (the same store)
    # tensor parallelism (engine/distributed/): ranks 1..N-1 run in spawned worker processes
    tensor_parallel_size: int = 1
    # where the model comes from (engine/hub.py; vLLM's flags of the same names)
    tokenizer: str | None = None  # a path or Hub id to load the tokenizer from instead of the model's
    revision: str | None = None  # Hub branch, tag or commit of the model
    tokenizer_revision: str | None = None  # the same for the tokenizer
    download_dir: str | None = None  # the Hugging Face cache folder Hub ids are downloaded into / read from
    trust_remote_code: bool = False  # let transformers run a repository's tokenizer/config code (never model code)

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if not isinstance(self.watermark, (int, float)) or not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be a boolean, got {self.trust_remote_code!r}")
        for name in ("model", "tokenizer", "revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if (value is not None or name == "model") and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a boolean, got {self.enable_prefix_caching!r}")
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm_backend must be one of {GEMM_BACKENDS}, got {self.gemm_backend!r}")
        if self.layer_ops not in GEMM_BACKENDS:
            raise ValueError(f"layer_ops must be one of {GEMM_BACKENDS}, got {self.layer_ops!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.gemm_backend == "cpu" and self.quantization is not None:
            raise ValueError(f"gemm_backend='cpu' packs float32 weights; quantization={self.quantization!r} brings "
                             f"its own kernel (use gemm_backend 'auto')")
        for name in ("swap_space", "lossless_host_memory"):
            if getattr(self, name) not in (0, "0"):
                parse_memory(getattr(self, name))  # a clear error now
        if self.kv_cache_dtype != "auto" and not (
                self.kv_cache_dtype in _DTYPES.values() if isinstance(self.kv_cache_dtype, torch.dtype)
                else self.kv_cache_dtype in _DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.kv_cache_dtype!r}")

    def model_source(self) -> ModelSource:
        """The model, its tokenizer and where their files come from (Hub ids are resolved by `ModelSource.resolve`)."""
        return ModelSource(self.model, self.tokenizer, self.revision, self.tokenizer_revision, self.download_dir,
                           self.trust_remote_code)

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The KV pages' dtype. Attention, compression scorers and sampling still compute in the model dtype: a
        half-precision cache halves the bytes a decode step reads (what bounds CPU decode at long contexts) and
        doubles the blocks a memory budget holds. CPU only for now (the CUDA path plans FlashInfer with one dtype)."""
        kv = model_dtype if self.kv_cache_dtype == "auto" else parse_dtype(self.kv_cache_dtype)
        if kv != model_dtype:
            if device.type != "cpu":
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} differs from the model dtype; only 'auto' "
                                 f"is supported on {device.type}")
            if self.tensor_parallel_size > 1:
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: use 'auto' with tensor_parallel_size > 1")
        return kv

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
        head split then gives every tensor-parallel size the same number of blocks. The CUDA default is 80% of each
        rank's own free device memory."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        c = model_config
        heads = c.num_kv_heads if num_kv_heads is None else num_kv_heads
        if self.kv_cache_memory is not None:
            budget = parse_memory(self.kv_cache_memory) // self.tensor_parallel_size
        elif device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(device)[0] * 0.8)
        else:
            budget = 2 * 2**30 // self.tensor_parallel_size
        n = num_blocks_for_memory(budget, c.num_layers, self.block_size, heads, c.head_dim, dtype)
        if n < 1:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r} is smaller than one KV block "
                             f"({bytes_per_block(c.num_layers, self.block_size, heads, c.head_dim, dtype)} "
                             f"bytes)")
        return n

    def host_blocks(self, model_config, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
        """Blocks of the host store: swap space plus the lossless full tier (one pool, one tensor), of this rank's KV
        heads. Both are host memory for the whole engine, split evenly over the tensor-parallel ranks."""
        nbytes = sum(parse_memory(v) for v in (self.swap_space, self.lossless_host_memory) if v not in (0, "0"))
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

"""Test helpers: a tiny page-table allocator (independent of paging/block_pool.py) and tiny random HF models."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from engine.attention.base import AttentionMetadata, build_metadata
from engine.attention.torch_paged import TorchPagedBackend


class PageTable:
    """Hands out shuffled, non-contiguous block ids and builds step metadata for a set of sequences."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.kv_lens: dict[int, int] = {}

    def grow(self, seq: int, n: int) -> None:
        """Reserve n more KV slots for `seq`."""
        table = self.tables.setdefault(seq, [])
        new_len = self.kv_lens.get(seq, 0) + n
        while len(table) * self.block_size < new_len:
            table.append(self.free.pop())
        self.kv_lens[seq] = new_len

    def step(self, q_lens: dict[int, int], device="cpu", write: bool = True) -> AttentionMetadata:
        """Metadata for a step adding q_lens[seq] tokens to each listed sequence (in dict order).
        With write=False, the tokens are the last q_lens[seq] slots already in the cache."""
        if write:
            for seq, n in q_lens.items():
                self.grow(seq, n)
        seqs = list(q_lens)
        return build_metadata([self.tables[s] for s in seqs], [q_lens[s] for s in seqs],
                              [self.kv_lens[s] for s in seqs], self.block_size, device=device, write=write)


class Runner:
    """Drives DecoderLM step by step over a paged cache with shuffled, non-contiguous blocks."""

    def __init__(self, model, config, seed=0, block_size=4, num_blocks=96, dtype=torch.float32, attn=None):
        self.model, self.config = model, config
        self.pages = PageTable(num_blocks, block_size, seed=seed)
        self.caches = new_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                                   config.head_dim, dtype)
        self.attn = attn or TorchPagedBackend()

    def _inputs(self, chunks, positions, write):
        meta = self.pages.step({s: len(t) for s, t in chunks.items()}, write=write)
        ids = torch.tensor([t for s in chunks for t in chunks[s]])
        pos = torch.tensor([p for s in chunks for p in positions[s]])
        c = self.config
        self.attn.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, self.caches[0].dtype)
        return ids, pos, meta

    def step(self, chunks: dict[int, list[int]], positions: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step; returns each sequence's logits [len(chunk), V]."""
        ids, pos, meta = self._inputs(chunks, positions, write=True)
        logits = self.model.compute_logits(self.model(ids, pos, self.caches, self.attn, meta))
        return dict(zip(chunks, logits.split([len(t) for t in chunks.values()])))

    def queries(self, chunks, positions) -> torch.Tensor:
        ids, pos, meta = self._inputs(chunks, positions, write=False)
        return self.model.recompute_queries(ids, pos, self.caches, self.attn, meta)


class TPRunner(Runner):
    """Runner for one tensor-parallel rank of a sharded DecoderLM. Only rank 0 owns the page table; each step
    it broadcasts the plan (ids, positions, block tables, q/kv lengths) over the CPU group, every rank builds the
    same metadata from it and runs its shard over its own KV cache, which holds only its KV heads (the same
    block ids on every rank). Workers call step()/queries() with no arguments."""

    def __init__(self, model, config, tp, seed=0, block_size=4, num_blocks=96, dtype=torch.float32):
        from engine.distributed.kv import common_num_blocks

        self.model, self.config, self.tp = model, config, tp
        num_blocks = common_num_blocks(num_blocks, tp)
        self.pages = PageTable(num_blocks, block_size, seed=seed) if tp.rank == 0 else None
        self.block_size = block_size
        self.caches = new_kv_cache(config.num_layers, num_blocks, block_size, model.num_local_kv_heads,
                                   config.head_dim, dtype)
        self.attn = TorchPagedBackend()

    def _inputs(self, chunks, positions, write):
        from engine.distributed.comm import broadcast_object

        plan = None
        if self.tp.rank == 0:
            meta = self.pages.step({s: len(t) for s, t in chunks.items()}, write=write)
            plan = dict(ids=[t for s in chunks for t in chunks[s]], pos=[p for s in chunks for p in positions[s]],
                        tables=meta.block_tables, q_lens=meta.q_lens, kv_lens=meta.kv_lens, write=write,
                        seqs=list(chunks))
        plan = broadcast_object(plan, self.tp)
        meta = build_metadata(plan["tables"], plan["q_lens"], plan["kv_lens"], self.block_size, write=plan["write"])
        self.attn.plan(meta, self.model.num_local_q_heads, self.model.num_local_kv_heads, self.config.head_dim,
                       self.caches[0].dtype)
        return torch.tensor(plan["ids"]), torch.tensor(plan["pos"]), meta, plan

    def step(self, chunks=None, positions=None):
        """Rank 0: each sequence's logits [len(chunk), V]; other ranks: None."""
        with torch.inference_mode():
            ids, pos, meta, plan = self._inputs(chunks, positions, write=True)
            logits = self.model.compute_logits(self.model(ids, pos, self.caches, self.attn, meta))
        if logits is None:
            return None
        return dict(zip(plan["seqs"], logits.split(plan["q_lens"])))

    def queries(self, chunks=None, positions=None) -> torch.Tensor:
        """This rank's query heads [L, T, Hq / tp, D]."""
        with torch.inference_mode():
            ids, pos, meta, _ = self._inputs(chunks, positions, write=False)
            return self.model.recompute_queries(ids, pos, self.caches, self.attn, meta)


def new_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device="cpu") -> list[torch.Tensor]:
    """Per-layer NHD page tensors [num_blocks, 2, block_size, Hkv, D], views of one tensor like KVCache (NaN where
    nothing was written). `dtype` may name an 8-bit format (paging/kv_format.py): rows of D values and their scale,
    filled with 0x7F bytes."""
    if isinstance(dtype, str):
        from paging.kv_format import kv_format

        fmt = kv_format(dtype, torch.float32)
        kv = torch.full((num_layers, num_blocks, 2, block_size, num_kv_heads, fmt.width(head_dim)), 0x7F,
                        dtype=torch.uint8, device=device).view(fmt.storage)
        return list(kv.unbind(0))
    kv = torch.full((num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"),
                    dtype=dtype, device=device)
    return list(kv.unbind(0))


def tiny_decoder_pair(arch: str, transform, std: float = 0.1, dtype=torch.float32):
    """A tiny random DecoderLM in `dtype` (weights N(0, std)) and a float32 copy of it passed through `transform`
    (e.g. a weight repacking, quantization, other layer ops): (config, model, transformed)."""
    from torch import nn

    from engine.models.config import ModelConfig
    from engine.models.llama import DecoderLM

    c = ModelConfig.from_hf(tiny_hf_config(arch))
    torch.manual_seed(0)
    model = DecoderLM(c).to(dtype).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=std)
    other = DecoderLM(c).eval()
    other.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return c, model, transform(other)


#: a context and its continuation for teacher-forced comparisons against HF transformers
CTX, CONT = [3, 17, 29, 41, 5, 8, 60, 77, 12], [9, 8, 7, 6, 5, 44, 45, 46, 47, 48, 49, 50, 90, 91, 92, 93]


def hf_bf16_weight_logprobs(model_dir, round_linear_inputs: bool, dtype=torch.bfloat16) -> torch.Tensor:
    """HF transformers in float64 on the model's weights rounded to `dtype` (and, with `round_linear_inputs`, each
    linear layer's input too): the log-probabilities of CONT after CTX."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(dtype).double())
    if round_linear_inputs:
        for m in hf.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda _, args: (args[0].to(dtype).double(),))
    with torch.no_grad():
        logp = hf(torch.tensor([CTX + CONT])).logits[0].log_softmax(-1)
    return torch.tensor([logp[len(CTX) - 1 + i, t].item() for i, t in enumerate(CONT)])


def max_logprob_error(engine, want: torch.Tensor) -> float:
    """The largest gap between `engine`'s teacher-forced log-probabilities of CONT after CTX and `want`."""
    got = torch.tensor(engine.score(CTX, CONT, chunk_size=3).prompt_logprobs, dtype=torch.float64)
    return (got - want).abs().max().item()


def assert_converts_to_the_float32_model(arch: str, convert, reference, refused_dtype, refused: str,
                                         dtype=torch.bfloat16) -> None:
    """`convert` (in place) of a tiny `dtype` model and `reference` of a float32 copy of its values give the same
    float32 logits and recomputed queries, bit for bit (the Qwen2 qkv bias included); `convert` refuses a model of
    `refused_dtype` with a ValueError matching `refused`."""
    import pytest

    c, half, ref = tiny_decoder_pair(arch, reference, dtype=dtype)
    convert(half)
    assert all(p.dtype == torch.float32 for p in half.parameters())
    (la, qa), (lb, qb) = mixed_batch_outputs(c, [half, ref])
    assert la.dtype == torch.float32 and torch.equal(la, lb) and torch.equal(qa, qb)
    other = tiny_decoder_pair(arch, lambda m: m, dtype=refused_dtype)[1]
    with pytest.raises(ValueError, match=refused):
        convert(other)


def mixed_batch_outputs(c, models):
    """Each model's logits and recomputed queries over the same mixed batch (a 6-token prefill on top of 0 cached
    tokens and a 7-token one), through the CPU paged backend: [(logits, queries)] per model."""
    from engine.attention.base import build_metadata
    from engine.attention.cpu_paged import CpuPagedBackend

    meta = build_metadata([[3, 5], [0, 6]], [6, 7], [6, 7], 4)
    meta_r = build_metadata([[3, 5], [0, 6]], [6, 7], [6, 7], 4, write=False)
    ids = torch.randint(0, c.vocab_size, (13,))
    pos = torch.tensor(list(range(6)) + list(range(7)))
    be = CpuPagedBackend()
    out = []
    for model in models:
        cache = new_kv_cache(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim)
        be.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, torch.float32)
        logits = model.compute_logits(model(ids, pos, cache, be, meta))
        be.plan(meta_r, c.num_q_heads, c.num_kv_heads, c.head_dim, torch.float32)
        out.append((logits, model.recompute_queries(ids, pos, cache, be, meta_r)))
    return out


def tiny_hf_config(arch: str, **overrides):
    """A tiny GQA config (4 q heads / 2 kv heads, head_dim 16) for 'llama', 'qwen2' or 'qwen3'; `overrides`
    replace any of the shared fields (e.g. num_key_value_heads=1)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    if arch == "llama":
        # Llama 3 style RoPE scaling so the "llama3" path is exercised.
        return LlamaConfig(num_hidden_layers=3, tie_word_embeddings=False, rope_theta=50000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           architectures=["LlamaForCausalLM"], **common)
    if arch == "qwen2":
        return Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=10000.0,
                           architectures=["Qwen2ForCausalLM"], **common)
    if arch == "qwen3":
        return Qwen3Config(num_hidden_layers=2, head_dim=16, tie_word_embeddings=True, rope_theta=1000000.0,
                           architectures=["Qwen3ForCausalLM"], **common)
    raise ValueError(arch)


def make_tiny_hf_model(arch: str, path: Path, seed: int = 0, max_shard_size=None, config_overrides=None):
    """Random tiny HF causal LM saved with save_pretrained (safetensors) to `path`; returns the HF model (fp32,
    eager attention, eval mode). Qwen2 gets nonzero q/k/v biases, every norm a non-trivial weight.
    `config_overrides` go to tiny_hf_config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(arch, **(config_overrides or {}))
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def save_tiny_tokenizer(path: Path, vocab_size: int = 128) -> None:
    """A word-level tokenizer over 'w3 w17 ...' words, saved next to a tiny model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)


# ---- multi-process tests ------------------------------------------------------------------------------------------
def hard_timeout(seconds: float):
    """A hard deadline for a multi-process test: if it is still running after `seconds`, every thread's traceback is
    printed and the test process exits (worker processes notice their parent is gone and exit too), so CI fails
    instead of hanging. Use as a context manager."""
    import contextlib
    import faulthandler
    import sys

    @contextlib.contextmanager
    def guard():
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()

    return guard()


def tp_worker_processes() -> list:
    """Tensor-parallel worker processes of this process that are still alive."""
    import multiprocessing as mp

    return [p for p in mp.active_children() if p.name.startswith("kvllm-tp-rank")]


def die_with_parent() -> None:
    """`preexec_fn` for test subprocesses (servers, the router): the kernel kills the child with SIGKILL when the
    test process dies, even by hard_timeout's exit, so no server outlives its test (Linux; a no-op elsewhere)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except OSError:
        pass


def lay_out_hub_cache(cache: Path, repo_id: str, files_from: Path, commit: str, ref: str | None = "main",
                      only: tuple[str, ...] | None = None) -> Path:
    """Put the files of `files_from` into a Hugging Face cache folder as huggingface_hub lays out a download:
    ``models--org--name/blobs/<sha256>``, ``snapshots/<commit>/<file>`` symlinks to them, and ``refs/<ref>`` holding
    the commit. `only` keeps the files with these suffixes. Returns the snapshot folder."""
    import hashlib
    import os

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(files_from.iterdir()):
        if not f.is_file() or (only is not None and not f.name.endswith(only)):
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot

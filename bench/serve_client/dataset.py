"""Prompts for `kvllm bench serve`: vLLM's ``random`` dataset (token ids decoded to text and re-encoded to the target
length) and ``text:FILE`` (jsonl prompts or windows of a text file)."""
from __future__ import annotations


import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np



# Words for prompts when no tokenizer is available (roughly one token each for BPE vocabularies).
_WORDS = ("the of and to in is was for on that with as by at from his her are be this an which or had it not "
          "were but have one their has been they more also its first new other after who all two when there "
          "time year can would into only most some made over may such these many where like three world "
          "city state part early under used both during later called between great well known including "
          "people since being while same around before second work number life small large different").split()


# ================================================================================================ dataset
@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens by the client's tokenizer (an estimate when it has none)
    expected_output_len: int


def load_tokenizer(name: Any):
    """A tokenizer from 'smollm2', a .gguf file, a local directory, or a locally cached HF id; an object is
    returned as is; None/'none' → None."""
    if name is None or (isinstance(name, str) and name.lower() == "none"):
        return None
    if not isinstance(name, (str, os.PathLike)):
        return name
    from transformers import AutoTokenizer

    name = str(name)
    if name == "smollm2":
        from engine.loader import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return AutoTokenizer.from_pretrained(str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return AutoTokenizer.from_pretrained(str(path), gguf_file=ggufs[0].name)
    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def _decode_to_target_len(tokenizer, token_ids: list[int], target: int, rng: np.random.Generator,
                          max_retry: int = 10) -> tuple[str, int]:
    """Decode, re-encode and trim/extend until the prompt re-encodes to `target` tokens (vLLM's procedure)."""
    tokens = list(token_ids)
    prompt = ""
    for attempt in range(max_retry + 1):
        prompt = tokenizer.decode(tokens)
        tokens = tokenizer.encode(prompt, add_special_tokens=False)
        if len(tokens) == target or attempt == max_retry:
            break
        if len(tokens) < target:
            tokens.extend(rng.integers(0, tokenizer.vocab_size, size=target - len(tokens)).tolist())
        else:
            tokens = tokens[:target]
    return prompt, len(tokens)


def _lengths(rng: np.random.Generator, n: int, input_len: int, output_len: int, ratio: float,
             num_special: int = 0) -> tuple[np.ndarray, np.ndarray]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    real = max(0, input_len - num_special)
    in_lo, in_hi = math.floor(real * (1 - ratio)), math.ceil(real * (1 + ratio))
    out_lo, out_hi = max(1, math.floor(output_len * (1 - ratio))), max(1, math.ceil(output_len * (1 + ratio)))
    return rng.integers(in_lo, in_hi + 1, size=n), rng.integers(out_lo, out_hi + 1, size=n)


def sample_random(tokenizer, num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    if tokenizer is None:
        in_lens, out_lens = _lengths(rng, num_requests, input_len, output_len, range_ratio)
        prefix = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=prefix_len)]
        reqs = []
        for i in range(num_requests):
            words = prefix + [_WORDS[j] for j in rng.integers(0, len(_WORDS), size=max(1, int(in_lens[i])))]
            reqs.append(SampleRequest(" ".join(words), len(words), int(out_lens[i])))
        return reqs
    num_special = int(tokenizer.num_special_tokens_to_add()) if hasattr(tokenizer, "num_special_tokens_to_add") \
        else 0
    in_lens, out_lens = _lengths(rng, num_requests, input_len, output_len, range_ratio, num_special)
    vocab = int(tokenizer.vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([t for t in range(vocab) if t not in special])
    offsets = rng.integers(0, vocab, size=num_requests)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    reqs = []
    for i in range(num_requests):
        n = max(1, int(in_lens[i]))
        inner = allowed[(int(offsets[i]) + i + np.arange(n)) % len(allowed)].tolist()
        prompt, length = _decode_to_target_len(tokenizer, prefix + inner, prefix_len + n, rng)
        reqs.append(SampleRequest(prompt, length + num_special, int(out_lens[i])))
    return reqs


def sample_text_file(tokenizer, path: str, num_requests: int, input_len: int, output_len: int,
                     range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--dataset text:{path}: no such file")
    if p.suffix == ".jsonl":
        rows = []
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                obj = json.loads(line)
                prompt = obj.get("prompt") if isinstance(obj, dict) else None
                if not isinstance(prompt, str) or not prompt:
                    raise ValueError(f"{path}: every line needs a non-empty 'prompt' string")
                out = obj.get("output_len") or obj.get("max_tokens") or output_len
                rows.append((prompt, int(out)))
        if not rows:
            raise ValueError(f"{path}: no prompts")
        reqs = []
        for i in range(num_requests):  # cycle (oversample) when the file has fewer prompts
            prompt, out = rows[i % len(rows)]
            n = len(tokenizer.encode(prompt)) if tokenizer is not None else len(prompt.split())
            reqs.append(SampleRequest(prompt, n, out))
        return reqs
    text = p.read_text(encoding="utf-8", errors="replace")
    _, out_lens = _lengths(rng, num_requests, input_len, output_len, range_ratio)
    in_lens, _ = _lengths(rng, num_requests, input_len, output_len, range_ratio)
    if tokenizer is None:
        words = text.split()
        if not words:
            raise ValueError(f"{path}: empty")
        reqs = []
        for i in range(num_requests):
            n = max(1, min(int(in_lens[i]), len(words)))
            start = int(rng.integers(0, len(words) - n + 1))
            reqs.append(SampleRequest(" ".join(words[start:start + n]), n, int(out_lens[i])))
        return reqs
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"{path}: empty")
    reqs = []
    for i in range(num_requests):
        n = max(1, min(int(in_lens[i]), len(ids)))
        start = int(rng.integers(0, len(ids) - n + 1))
        prompt, length = _decode_to_target_len(tokenizer, ids[start:start + n], n, rng)
        reqs.append(SampleRequest(prompt, length, int(out_lens[i])))
    return reqs


def get_samples(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    dataset = args.dataset
    if dataset == "random":
        return sample_random(tokenizer, args.num_prompts, args.input_len, args.output_len, args.random_range_ratio,
                             args.random_prefix_len, args.seed)
    if dataset.startswith("text:"):
        return sample_text_file(tokenizer, dataset[5:], args.num_prompts, args.input_len, args.output_len,
                                args.random_range_ratio, args.seed)
    raise ValueError(f"--dataset must be 'random' or 'text:FILE', got {dataset!r}")

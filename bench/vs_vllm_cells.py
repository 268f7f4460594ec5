"""The cells of bench/vs_vllm_matrix.py: what each client run sends, their names, the `--cells` selection, and the
prompts (cut from the Python language reference, a text no other bench reads).

A cell is one endpoint x arrival process x client concurrency x prompt/output shape; its name spells those out
(`chat-mid-p6-c32`: chat endpoint, 256/256 tokens, Poisson at 6 req/s, at most 32 in flight). Every cell runs
under each server configuration, so a cell's qualified name is `config/cell` (`defaults/chat-mid-p6-c32`). The set
covers every level of every factor without the full product (hours on 2 cores). A Poisson cell's rate x output
length is above what either server decodes at its concurrency, so its output tok/s still measures the server,
not the arrivals.
"""
from __future__ import annotations

import fnmatch
import random
from dataclasses import dataclass, replace

ENDPOINTS = {"cmpl": "/v1/completions", "chat": "/v1/chat/completions"}
SHAPES = {"short": (128, 128), "mid": (256, 256), "longin": (1024, 128), "reason": (128, 1024)}  # prompt, output
CONFIGS = ("defaults", "explicit")  # each server's bare launch line; both at the same explicit settings
MEMORY_CONFIG = "memory"


@dataclass(frozen=True)
class Cell:
    endpoint: str  # a key of ENDPOINTS
    shape: str  # a key of SHAPES
    rate: str  # requests/s of the Poisson arrivals, or "inf": all at once
    concurrency: int  # the client's --max-concurrency
    num_prompts: int

    @property
    def name(self) -> str:
        arrivals = "inf" if self.rate == "inf" else f"p{self.rate}"
        return f"{self.endpoint}-{self.shape}-{arrivals}-c{self.concurrency}"

    @property
    def input_len(self) -> int:
        return SHAPES[self.shape][0]

    @property
    def output_len(self) -> int:
        return SHAPES[self.shape][1]


CELLS = [
    Cell("cmpl", "short", "inf", 1, 8),
    Cell("chat", "mid", "2", 1, 4),
    Cell("cmpl", "longin", "inf", 1, 4),
    Cell("chat", "reason", "inf", 1, 2),
    Cell("cmpl", "short", "6", 8, 32),
    Cell("chat", "short", "inf", 8, 32),
    Cell("cmpl", "longin", "6", 8, 24),
    Cell("chat", "reason", "2", 8, 16),
    Cell("chat", "mid", "6", 32, 48),  # the reproduction: 48 x ~256/256 at 6 req/s, at most 32 in flight
    Cell("cmpl", "mid", "6", 32, 48),
    Cell("cmpl", "short", "inf", 32, 64),
    Cell("chat", "longin", "6", 32, 32),
    Cell("cmpl", "reason", "inf", 32, 32),
    Cell("chat", "short", "inf", 64, 128),
    Cell("cmpl", "mid", "inf", 64, 96),
    Cell("chat", "longin", "inf", 64, 64),
]
REPRO = "chat-mid-p6-c32"  # also the cell whose TPOT is held against kvllm's decode-step floor


@dataclass(frozen=True)
class MemoryCell:
    """Requests all sent at once to a KV pool for `pool_seqs` uncompressed sequences (prompt + output each)."""
    num_prompts: int
    input_len: int
    output_len: int
    pool_seqs: int
    endpoint: str = "chat"
    name: str = "chat-pool3"


MEMORY = MemoryCell(12, 200, 1024, 3)


def sizes(cell: Cell | MemoryCell, quick: bool) -> tuple[int, int, int]:
    """(requests, prompt tokens, output tokens) of a cell; `quick`: pipeline-check sizes, seconds a cell."""
    if not quick:
        return cell.num_prompts, cell.input_len, cell.output_len
    return min(cell.num_prompts, 4), max(16, cell.input_len // 8), max(8, cell.output_len // 16)


def plan() -> list[tuple[str, str]]:
    """Every (config, cell name) of the matrix in run order: each cell under each configuration, then the
    memory-limited cell."""
    return [(config, cell.name) for config in CONFIGS for cell in CELLS] + [(MEMORY_CONFIG, MEMORY.name)]


def cell_named(name: str) -> Cell:
    return next(c for c in CELLS if c.name == name)


def select(pairs: list[tuple[str, str]], patterns: str | None) -> list[tuple[str, str]]:
    """The pairs whose `config/cell` or bare `cell` name matches one of the comma-separated globs (all when
    `patterns` is empty). A pattern that matches nothing is an error, so a typo does not run an empty matrix."""
    if not patterns:
        return list(pairs)
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    def hit(pair, g):
        return fnmatch.fnmatchcase(f"{pair[0]}/{pair[1]}", g) or fnmatch.fnmatchcase(pair[1], g)
    unknown = [g for g in globs if not any(hit(p, g) for p in pairs)]
    if unknown:
        raise ValueError(f"--cells: {', '.join(unknown)} matches no cell; cells are CONFIG/NAME with CONFIG in "
                         f"{', '.join((*CONFIGS, MEMORY_CONFIG))} and NAME such as {REPRO}")
    return [p for p in pairs if any(hit(p, g) for g in globs)]


def reference_text() -> str:
    """The Python language reference's topics (pydoc_data, in every CPython install): ~465k characters of English
    prose and grammar. The other benches read the license texts and module docstrings (bench/common.py)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def reference_prompts(tokenizer, num: int, length: int, seed: int) -> list[str]:
    """`num` prompts of `length` tokens of the reference text from spread-out offsets (a different seed per cell,
    so no cell finds another's prompts in a prefix cache); re-tokenized, a prompt may come out a token longer."""
    ids = tokenizer(reference_text()).input_ids
    rng = random.Random(seed)
    return [tokenizer.decode(ids[s:s + length]) for s in (rng.randrange(0, len(ids) - length) for _ in range(num))]


def cell_seed(name: str) -> int:
    """A seed fixed by the cell's name (Python's str hash is salted per process)."""
    return sum((i + 1) * ord(c) for i, c in enumerate(name))

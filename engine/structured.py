"""Structured outputs: constrain sampling to a JSON schema, any JSON object, a regex, a list of choices or an EBNF
grammar, with xgrammar (the grammar library vLLM and SGLang use; bench/structured_outputs.py compares it with
llguidance on this CPU).

* `StructuredOutputsParams` (engine/structured_params.py, vLLM's fields) is checked when built; its `param` names
  the request field the constraint came from (``response_format.json_schema``, ``guided_regex``...).
* `StructuredOutputs` (one per engine) compiles a constraint once per request (the library caches compiled
  grammars by spec) and gives each sequence its own `GrammarState` (an xgrammar matcher).
* Each step, `mask` fills the bitmasks of the batch's constrained rows in one library call and applies them to the
  logits in place (`apply_bitmask`: no Python loop over the vocabulary); `accept` advances a sequence's
  matcher with its committed token. EOS is allowed only where the grammar is complete (and is the only token
  allowed where nothing can follow); a matcher that took it finishes the sequence with "stop", ignore_eos or not.

The matcher follows a sequence's committed output tokens: preemption by recompute keeps the outputs and swap keeps
everything, so neither touches it; `sync` rolls it back or forward if the outputs ever change under it.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import InvalidRequestError
from engine.outputs import EngineStats
from engine.structured_params import GrammarLimits, StructuredOutputsParams, choice_grammar

if TYPE_CHECKING:
    from engine.sequence import Sequence

__all__ = ["StructuredOutputs", "StructuredOutputsParams", "GrammarLimits", "GrammarState", "apply_bitmask",
           "choice_grammar"]

CACHE_ENTRIES = 256  # compiled constraints kept (each holds per-state token masks: a few MB at most)


class _Rejected(Exception):
    """A constraint the library refused or no output satisfies; the waiting request names its own field."""


def _spec_key(so: StructuredOutputsParams) -> tuple:
    spec = getattr(so, so.kind)
    if so.kind == "json" and not isinstance(spec, str):
        spec = json.dumps(spec, sort_keys=True)
    elif so.kind == "choice":
        spec = tuple(spec)
    return so.kind, spec, so.disable_any_whitespace


@dataclass(eq=False)
class GrammarState:
    """One sequence's matcher and how many of its output tokens it has accepted. With ``after`` (a reasoning end
    marker's token ids) the grammar starts at output index ``start``, just past the marker's first occurrence;
    until then (``start`` None) the sequence samples freely."""
    matcher: Any
    num_accepted: int = 0
    after: tuple[int, ...] | None = None
    start: int | None = 0

    def __post_init__(self) -> None:
        self._scanned = 0  # output tokens already searched for the marker
        if self.after is not None:
            self.start = None

    def find_start(self, outputs: list[int]) -> int | None:
        """Where the grammar starts in ``outputs`` (None: the marker is not there yet). Outputs that shrank
        below a found start (never in normal operation) reset the matcher."""
        if self.start is not None and self.start > len(outputs):
            if self.num_accepted:
                self.matcher.rollback(self.num_accepted)
            self.num_accepted, self.start, self._scanned = 0, None, 0
        if self.start is None:
            n, first = len(self.after), max(0, min(self._scanned, len(outputs)) - len(self.after) + 1)
            for i in range(first, len(outputs) - n + 1):
                if outputs[i] == self.after[0] and tuple(outputs[i:i + n]) == self.after:
                    self.start = i + n
                    break
            self._scanned = len(outputs)
        return self.start

    @property
    def done(self) -> bool:
        """The matcher took a stop token (EOS), which it allows only where the grammar is complete."""
        return self.matcher.is_terminated()


class StructuredOutputs:
    """The engine's structured-output state: the tokenizer's info and the compiler (built on first use), a bounded
    pool of compile workers with a cache of their results, a bitmask buffer, and the batched mask / accept steps.

    Compiling runs on the pool, never on the thread that asks: the caller waits at most ``limits.timeout`` for its
    constraint (a 400 past it), the GIL is free while the library compiles, and neither the engine's step loop nor
    the server's event loop ever compiles. A constraint is checked against ``limits`` before it is queued."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], threads: int = 1, stats=None,
                 limits: GrammarLimits | None = None, workers: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.threads = max(1, threads)
        self.limits = limits if limits is not None else GrammarLimits()
        self._compiler = None
        self._batch = None
        self._lock = threading.Lock()  # requests are created on the callers' threads
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kvllm-grammar")
        # compiles by spec, finished or under way: a repeated constraint waits for no worker, and two requests
        # with one new constraint share one compile
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._bitmask: torch.Tensor | None = None
        self.stats = stats if stats is not None else EngineStats()  # adds structured_{fill,apply,accept}_seconds

    # -- compile ------------------------------------------------------------------------------------------
    def _xgr(self):
        try:
            import xgrammar
        except ImportError:
            raise InvalidRequestError("structured outputs need the xgrammar package (installed by `make install`)",
                                      "structured_outputs") from None
        return xgrammar

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = self._xgr()
                if self.tokenizer is None:
                    raise InvalidRequestError("structured outputs need a tokenizer; this model has none",
                                              "structured_outputs")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids)
                # the results are cached here (self._compiled), not twice
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
                self._batch = xgr.BatchGrammarMatcher(max_threads=self.threads)
            return self._compiler

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of a constraint. Over a limit, rejected by the library, satisfied by no output, or
        not compiled within the time limit: an InvalidRequestError naming the field it came from."""
        self.limits.check(so)
        self.compiler()  # a missing library or tokenizer is this request's error, not a worker's
        key = _spec_key(so)
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, so)
                while len(self._compiled) > CACHE_ENTRIES:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        try:
            return future.result(timeout=self.limits.timeout)
        except FutureTimeout:
            raise InvalidRequestError(f"{so.field}: the constraint did not compile within {self.limits.timeout:g} s "
                                      f"(--structured-outputs-compile-timeout)", so.field) from None
        except _Rejected as err:
            raise InvalidRequestError(f"{so.field}: {err}", so.field) from None

    def _compile(self, so: StructuredOutputsParams):
        """On a worker: compile, then refuse a constraint that no output satisfies (its first mask allows no
        token, EOS included), which would otherwise fail only once the request runs."""
        compiler = self.compiler()
        kind = so.kind
        try:
            if kind == "json":
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                compact = {"any_whitespace": False, "separators": (",", ":")} if so.disable_any_whitespace else {}
                compiled = compiler.compile_json_schema(schema, **compact)
            elif kind == "json_object":
                if so.disable_any_whitespace:
                    compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                            separators=(",", ":"))
                else:
                    compiled = compiler.compile_json_schema('{"type": "object"}')
            elif kind == "regex":
                compiled = compiler.compile_regex(so.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(so.choice))
            else:
                compiled = compiler.compile_grammar(so.grammar)
        except (RuntimeError, ValueError) as err:
            raise _Rejected(_library_message(err)) from None
        xgr = self._xgr()
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        if not mask.any():
            raise _Rejected("no output satisfies this constraint (it allows no first token)")
        return compiled

    def attach(self, seqs: list[Sequence], so: StructuredOutputsParams) -> None:
        """Compile the request's constraint (once) and give each of its sequences a matcher."""
        if any(s.lossless is not None for s in seqs):
            # lossless drafts would need a matcher rollback per rejected draft and masks at every verified
            # position; not supported yet
            raise InvalidRequestError("structured_outputs cannot be combined with kv_compression.lossless",
                                      so.field)
        compiled = self.compile(so)
        xgr = self._xgr()
        for seq in seqs:
            seq.structured = GrammarState(xgr.GrammarMatcher(compiled), after=so.after)

    def close(self) -> None:
        """Drop queued compiles; one under way finishes on its own (the library cannot be interrupted)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the step -----------------------------------------------------------------------------------------
    def _buffer(self, rows: int) -> torch.Tensor:
        width = math.ceil(self.vocab_size / 32)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = torch.full((max(rows, 64), width), -1, dtype=torch.int32)
        return self._bitmask[:rows]

    def mask(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Sequence, InvalidRequestError]]:
        """Set the logits of tokens each constrained row's grammar forbids to -inf, in place: one batched fill
        of the rows' bitmasks, then `apply_bitmask` over those rows. A row the grammar forces to a token banned
        elsewhere (EOS before min_tokens) gets the grammar's tokens back: the grammar wins. Returns the rows
        whose grammar allows no token at all (a constraint no output completes): their requests end with a 400."""
        rows = [i for i, s in enumerate(seqs)
                if s.structured is not None and s.structured.find_start(s.output_token_ids) is not None]
        if not rows:
            return []
        t0 = time.perf_counter()
        for i in rows:
            sync(seqs[i])
        bitmask = self._buffer(len(seqs))
        self._batch.batch_fill_next_token_bitmask([seqs[i].structured.matcher for i in rows], bitmask, rows)
        dead = [i for i, d in zip(rows, (bitmask[rows] == 0).all(1).tolist()) if d]
        failed = []
        if dead:
            rows = [i for i in rows if i not in dead]
            for i in dead:
                where = seqs[i].params.structured_outputs.field
                failed.append((seqs[i], InvalidRequestError(
                    f"{where}: no output satisfies this constraint (after {seqs[i].num_outputs} tokens it allows "
                    f"no next token)", where)))
        t1 = time.perf_counter()
        device_mask = bitmask.to(logits.device, non_blocking=True) if logits.device.type != "cpu" else bitmask
        before = logits[rows].clone() if _may_empty(seqs, rows) else None
        apply_bitmask(logits, device_mask, rows, self.vocab_size)
        if before is not None:
            _restore_empty_rows(logits, rows, before, bitmask, self.vocab_size)
        self.stats.structured_fill_seconds += t1 - t0
        self.stats.structured_apply_seconds += time.perf_counter() - t1
        return failed

    def accept(self, seq: Sequence, token: int) -> None:
        """Advance the sequence's matcher by its newly committed output token (already appended)."""
        st = seq.structured
        if st is None:
            return
        start = st.find_start(seq.output_token_ids)
        if start is None or start >= seq.num_outputs:
            return  # still reasoning, or this token completed the end marker: the grammar starts after it
        t0 = time.perf_counter()
        sync(seq, upto=seq.num_outputs - 1)
        if not st.matcher.accept_token(token):
            raise RuntimeError(f"structured outputs: the grammar rejected token {token} of request "
                               f"{seq.request_id} (the mask was not applied to its logits)")
        st.num_accepted += 1
        self.stats.structured_accept_seconds += time.perf_counter() - t0


def sync(seq: Sequence, upto: int | None = None) -> None:
    """Bring the matcher to the sequence's first `upto` output tokens past its start (default: all): roll back what is no longer
    there, accept what is new. A no-op while the two agree, which is the normal case."""
    st = seq.structured
    start = st.find_start(seq.output_token_ids)
    if start is None:
        return
    target = max(0, (seq.num_outputs if upto is None else upto) - start)
    if st.num_accepted > target:
        st.matcher.rollback(st.num_accepted - target)
        st.num_accepted = target
    while st.num_accepted < target:
        if not st.matcher.accept_token(seq.output_token_ids[start + st.num_accepted]):
            raise RuntimeError(f"structured outputs: request {seq.request_id}'s outputs left its grammar")
        st.num_accepted += 1


_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in rows (in place).

    xgrammar's CPU kernel skips all-allowed 32-token words but writes every banned token one by one, so a row
    where the grammar allows a few tokens (most JSON positions outside strings) costs it a full row of scattered
    writes. Such rows (fewer words with an allowed token than words with a banned one) go another way here: keep
    the allowed logits, fill the row with -inf, put them back. The other rows, and every row off the CPU, take the
    library's kernel."""
    import xgrammar as xgr

    sparse: list[int] = []
    if logits.device.type == "cpu":
        words = bitmask[rows]
        few = ((words != 0).sum(1) < (words != -1).sum(1)).tolist()
        sparse = [r for r, f in zip(rows, few) if f]
    chosen = set(sparse)
    dense = [r for r in rows if r not in chosen]
    if dense:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=dense)
    if not sparse:
        return
    index = torch.tensor(sparse)
    words = bitmask[index]
    w_row, w_col = (words != 0).nonzero(as_tuple=True)
    bit_row, bit = (((words[w_row, w_col].unsqueeze(-1) >> _SHIFTS) & 1) != 0).nonzero(as_tuple=True)
    r, c = index[w_row[bit_row]], w_col[bit_row] * 32 + bit
    keep = c < min(vocab, logits.shape[1])
    r, c = r[keep], c[keep]
    values = logits[r, c]
    logits.index_fill_(0, index, float("-inf"))
    logits[r, c] = values


def _may_empty(seqs: list[Sequence], rows: list[int]) -> bool:
    """Only rows still under min_tokens had tokens banned before the mask (their EOS / stop ids)."""
    return any(seqs[i].num_outputs < seqs[i].params.min_tokens for i in rows)


def _restore_empty_rows(logits: torch.Tensor, rows: list[int], before: torch.Tensor, bitmask: torch.Tensor,
                        vocab: int) -> None:
    empty = [j for j, i in enumerate(rows) if not torch.isfinite(logits[i]).any()]
    for j in empty:
        i = rows[j]
        bits = (bitmask[i].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[:vocab].nonzero().flatten().to(logits.device)
        logits[i, allowed] = torch.where(torch.isfinite(before[j, allowed]), before[j, allowed],
                                         torch.zeros_like(before[j, allowed]))


def _library_message(err: BaseException) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location: keep the sentence."""
    text = str(err).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ": " in text and ".cc:" in text.split(": ", 1)[0]:
        text = text.split(": ", 1)[1]
    return text.strip() or type(err).__name__

"""Turns sampled tokens into text and finish decisions, and sequences into user-facing outputs.

Detokenization is incremental: tokenizers' DecodeStream turns each new token into the text it completes (whole
characters only), in Rust, where the tokenizer is a fast one whose decode transformers does not post-process; else a
short trailing window is decoded each step and only complete characters are appended. Stop strings are searched in
the new text only; streaming deltas hold back text that could still turn into a stop string.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from tokenizers.decoders import DecodeStream

from engine.errors import RequestFailedError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sequence import Sequence


def stream_backend(tokenizer) -> Any:
    """The tokenizers.Tokenizer a DecodeStream can run on for this tokenizer, or None: a slow tokenizer has none, and
    one that cleans up spaces after decoding (transformers' clean_up_tokenization_spaces) would give other text."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, stats: Any = None,
                 structured: Any = None, finish: Callable[[Sequence], None] | None = None):
        self.tokenizer = tokenizer
        self.backend = stream_backend(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stats = stats  # the engine's counters (generation_tokens_total)
        self.structured = structured  # engine/structured.py: a grammar matcher advances with each token
        self.finish = finish  # the scheduler's: a finished sequence gives its blocks back

    # -- the step's results -------------------------------------------------------------------------------
    def update_from_output(self, scored: list[tuple[Sequence, list[float], list[dict[int, float]]]],
                           tokens: list[tuple[Sequence, int, tuple | None]]) -> list[tuple[Sequence, BaseException]]:
        """Teacher-forced scores and sampled tokens to their sequences; returns the sequences whose own output
        processing failed (their requests end alone)."""
        for seq, logps, tops in scored:
            seq.scoring.prompt_logprobs.extend(logps)
            seq.scoring.prompt_top.extend(tops)
        failed = []
        for seq, token, logprob in tokens:
            try:
                self.append(seq, token, logprob)
            except Exception as err:
                failed.append((seq, RequestFailedError("processing its output", err)))
        return failed

    def append(self, seq: Sequence, token: int, logprob: tuple | None) -> bool:
        """Commit one generated token: outputs, logprobs, detokenization, stop checks. Returns whether the sequence
        is finished (a sequence already finished takes nothing)."""
        if seq.is_finished:
            return True
        seq.output_token_ids.append(token)
        self.structured.accept(seq, token)  # raises if the grammar rejects it
        self.stats.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if logprob is not None:
            chosen, ids, vals = logprob
            entry = {token: chosen}
            for tid, val in zip(ids, vals):
                entry.setdefault(tid, val)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += chosen
        if self.append_token(seq, token):
            self.finish(seq)
            return True
        return False

    def append_token(self, seq: Sequence, token: int) -> bool:
        """Detokenize the sequence's newest token (already appended) and decide whether it finished."""
        self.detokenize(seq)
        reason, stop_reason = self.check_stop(seq, token)
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.flush(seq)
        return True

    def decode(self, ids: list[int], seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def detokenize(self, seq: Sequence) -> None:
        """Incremental detokenization: append the complete characters the new tokens finish. The offsets move as
        the windowed decode's do either way, so `flush` can decode what a finished sequence still holds back."""
        ids, d = seq.output_token_ids, seq.detok
        if self.backend is not None:
            if d.stream is None:
                d.stream = DecodeStream(skip_special_tokens=seq.params.skip_special_tokens)
            new = d.stream.step(self.backend, ids[d.fed:])
            d.fed = len(ids)
            if new:
                self._append_text(seq, new)
                d.prefix_offset = d.read_offset
                d.read_offset = len(ids)
            return
        prefix = self.decode(ids[d.prefix_offset:d.read_offset], seq)
        full = self.decode(ids[d.prefix_offset:], seq)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._append_text(seq, full[len(prefix):])
            d.prefix_offset = d.read_offset
            d.read_offset = len(ids)

    def flush(self, seq: Sequence) -> None:
        if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
            return
        ids, d = seq.output_token_ids, seq.detok
        if d.read_offset < len(ids):
            prefix = self.decode(ids[d.prefix_offset:d.read_offset], seq)
            full = self.decode(ids[d.prefix_offset:], seq)
            d.text += full[len(prefix):]
            d.read_offset = len(ids)

    def _append_text(self, seq: Sequence, new: str) -> None:
        d = seq.detok
        start = len(d.text)
        d.text += new
        for stop in seq.params.stop_strings:
            idx = d.text.find(stop, max(0, start - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
                d.text = d.text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return

    def check_stop(self, seq: Sequence, token: int) -> tuple[str | None, str | int | None]:
        p = seq.params
        if seq.finish_reason == "stop":  # a stop string matched during detokenization
            return "stop", seq.stop_reason
        if seq.structured is not None and seq.structured.done:  # the grammar took its stop token: nothing can follow
            return "stop", None
        if seq.num_outputs >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and seq.num_outputs >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def completion(self, seq: Sequence, delta: bool) -> CompletionOutput:
        tokens, d = seq.output_token_ids, seq.detok
        text = d.text
        if not seq.is_finished and seq.params.stop_strings:
            # hold back what could still become a stop string
            hold = max(len(s) for s in seq.params.stop_strings) - 1
            text = text[:max(len(text) - hold, d.sent_text)]
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        if delta:
            out_tokens, out_text = tokens[d.sent_tokens:], text[d.sent_text:]
            logprobs = logprobs[d.sent_tokens:] if logprobs is not None else None
            d.sent_tokens, d.sent_text = len(tokens), len(text)
        else:
            out_tokens, out_text = list(tokens), text
        return CompletionOutput(
            index=seq.index, text=out_text, token_ids=list(out_tokens),
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def request_output(self, req, delta: bool) -> RequestOutput:
        firsts = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        scheduled = [s.first_scheduled_time for s in req.seqs if s.first_scheduled_time is not None]
        metrics = RequestMetrics(req.arrival_time, min(firsts) if firsts else None,
                                 time.monotonic() if req.finished else None,
                                 sum(s.num_preemptions for s in req.seqs), min(scheduled, default=None))
        scoring = req.seqs[0].scoring
        prompt_logprobs = None
        if scoring is not None:  # Engine.score: floats; a request's prompt_logprobs: vLLM's per-position dicts
            prompt_logprobs = (list(scoring.prompt_logprobs) if scoring.decode_like else
                               [None] + [({req.prompt_token_ids[t + 1]: lp, **top}, rank) for t, (lp, (top, rank))
                                         in enumerate(zip(scoring.prompt_logprobs, scoring.prompt_top))])
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                             [self.completion(s, delta) for s in req.seqs], req.finished, metrics,
                             prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=req.seqs[0].num_cached_tokens)

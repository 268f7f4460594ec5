"""Structured outputs on SmolLM2 (CPU): which grammar library, and what the constraint costs a decode step.

1. Libraries (xgrammar, which the engine uses, vs llguidance when installed), on SmolLM2's tokenizer (49152
   tokens): tokenizer-info build, grammar compile (a realistic JSON schema, json_object, a regex; no cache),
   the per-step bitmask fill at batch 1 and 32 while matchers walk a valid document, token accept, and the mask
   applied to a [32, V] float32 logits tensor (the library's kernel and plain torch ops).
2. The engine at batch 32: the same 32 real-text prompts decoded greedily, unconstrained (ignore_eos) vs under a
   JSON schema that cannot finish within max_tokens (an array of records with many required items), so both
   sides decode the same number of tokens at full batch. Repeats alternate the two; medians. Reported: output
   tok/s, the median pure decode step (all 32 running, no prompt token in the step), and the structured-output
   time per such step split into bitmask fill, apply and accept (EngineStats.structured_*_seconds).

    .venv/bin/python -m bench.structured_outputs [--threads 1] [--repeats 3] [--output-len 64] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from engine.threads import configure_threads

configure_threads(1, wait_policy="passive")  # before torch loads (see bench/offline_throughput.py)

import torch  # noqa: E402

from bench.common import RESULTS, median, text_prompts, write_section  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402

SCHEMA = {  # realistic: nested object, enum, bounded strings and arrays, a pattern, numbers, booleans
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["id", "name", "role", "active", "tags"],
    "additionalProperties": False,
}
DOC = {"id": 4217, "name": "Ada Lovelace, Countess of Lovelace", "email": "ada.king@analytical.org",
       "role": "editor", "active": True, "score": 97.25, "tags": ["math", "poetry", "engines"],
       "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"}}
REGEX = r"(\+1 )?\(\d{3}\) \d{3}-\d{4}|[A-Z][a-z]+ [A-Z][a-z]+ <[a-z0-9.]+@[a-z]+\.(com|org|net)>"
# the throughput workload: records until max_tokens (at least 200 of them are required)
RECORDS = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "maxLength": 24},
                                     "email": {"type": "string", "maxLength": 32}, "active": {"type": "boolean"},
                                     "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                              "maxItems": 4}},
    "required": ["id", "name", "email", "active", "tags"], "additionalProperties": False}}


# ------------------------------------------------------------------------------------------- libraries
class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, threads: int, eos: list[int]):
        import xgrammar as xgr

        self.x, self.threads = xgr, threads
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.info_seconds = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str):
        c = self.x.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if kind == "regex":
            return c.compile_regex(REGEX)
        schema = SCHEMA if kind == "schema" else {"type": "object"}
        return c.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, grammar):
        return self.x.GrammarMatcher(grammar)

    def accept(self, m, token: int) -> None:
        assert m.accept_token(token)

    def fill_one(self, m, bitmask, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def apply(self, logits, bitmask) -> None:
        self.x.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, threads: int, eos: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.l, self.lt = llguidance, llguidance.torch
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos[0])
        self.info_seconds = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str):
        m = self.l.LLMatcher
        if kind == "regex":
            grammar = m.grammar_from_regex(REGEX)
        else:
            grammar = m.grammar_from_json_schema(SCHEMA if kind == "schema" else {"type": "object"},
                                                 defaults={"whitespace_flexible": False})
        matcher = m(self.tok, grammar)  # llguidance builds its lexer lazily: part of the work is left for decoding
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar):
        return self.l.LLMatcher(self.tok, grammar)

    def accept(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    def fill_one(self, m, bitmask, row: int) -> None:
        self.lt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms, bitmask) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def apply(self, logits, bitmask) -> None:
        # llguidance's own kernel is torch.compile'd (seconds to compile on first use); the torch-ops form
        torch_apply(logits, bitmask)


def torch_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    logits.masked_fill_(bits.view(bitmask.shape[0], -1)[:, :logits.shape[1]] == 0, float("-inf"))


def library_row(lib, doc_ids: list[int], vocab: int, batch: int = 32) -> dict:
    out = {"info": lib.info_seconds}
    for kind in ("schema", "object", "regex"):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            lib.compile(kind)
            times.append(time.perf_counter() - t0)
        out[f"compile_{kind}"] = median(times)
    grammar = lib.compile("schema")
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    m, fills, accepts = lib.matcher(grammar), [], []
    for t in doc_ids:  # batch 1: a fresh matcher walks the document (the first pass pays any lazy work)
        t0 = time.perf_counter()
        lib.fill_one(m, bitmask, 0)
        t1 = time.perf_counter()
        lib.accept(m, t)
        fills.append(t1 - t0)
        accepts.append(time.perf_counter() - t1)
    out.update(fill1_median=median(fills), fill1_mean=statistics.mean(fills), fill1_max=max(fills),
               accept=median(accepts))
    # batch 32: matchers spread over the document, every step fills all 32 (one library call) and accepts
    span = len(doc_ids) - 40
    ms = []
    for i in range(batch):
        m, pos = lib.matcher(grammar), (i * 7) % span
        for t in doc_ids[:pos]:
            lib.accept(m, t)
        ms.append([m, pos])
    steps = []
    for _ in range(30):
        t0 = time.perf_counter()
        lib.fill_batch([m for m, _ in ms], bitmask)
        steps.append(time.perf_counter() - t0)
        for entry in ms:
            lib.accept(entry[0], doc_ids[entry[1]])
            entry[1] += 1
    out["fill32"] = median(steps)
    loop = []
    for _ in range(10):  # the same fills one matcher at a time
        t0 = time.perf_counter()
        for i, (m, _) in enumerate(ms):
            lib.fill_one(m, bitmask, i)
        loop.append(time.perf_counter() - t0)
    out["fill32_loop"] = median(loop)
    # the masks of those 32 states (the last fill) applied to [32, V] float32 logits, three ways
    from engine.structured import apply_bitmask

    logits = torch.randn(batch, vocab)
    rows = list(range(batch))
    times: dict[str, list[float]] = {"lib": [], "torch": [], "engine": []}
    for _ in range(20):
        results = []
        for key, fn in (("lib", lambda x: lib.apply(x, bitmask)), ("torch", lambda x: torch_apply(x, bitmask)),
                        ("engine", lambda x: apply_bitmask(x, bitmask, rows, vocab))):
            x = logits.clone()
            t0 = time.perf_counter()
            fn(x)
            times[key].append(time.perf_counter() - t0)
            results.append(x)
        assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    out.update({f"apply_{k}": median(v) for k, v in times.items()})
    return out


def libraries_table(tokenizer, vocab: int, eos: list[int], threads: int) -> str:
    doc_ids = tokenizer(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False).input_ids
    rows = []
    for cls in (XGrammar, LLGuidance):
        try:
            lib = cls(tokenizer, vocab, threads, eos)
        except ImportError:
            print(f"{cls.name} is not installed (pip install llguidance==1.9.1 to compare): skipped")
            continue
        rows.append((cls.name, library_row(lib, doc_ids, vocab)))
    ms, us = (lambda s: f"{s * 1e3:.1f} ms"), (lambda s: f"{s * 1e6:.0f} us")
    lines = ["| library | tokenizer info | compile schema / json_object / regex | fill b=1 median (mean, max) "
             "| fill b=32 per step: batched (loop) | accept per token | apply [32, V]: library / torch ops / "
             "engine |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        lines.append(f"| {name} | {ms(r['info'])} | {ms(r['compile_schema'])} / {ms(r['compile_object'])} / "
                     f"{ms(r['compile_regex'])} | {us(r['fill1_median'])} ({us(r['fill1_mean'])}, "
                     f"{ms(r['fill1_max'])}) | {ms(r['fill32'])} ({ms(r['fill32_loop'])}) | "
                     f"{r['accept'] * 1e6:.1f} us | "
                     f"{ms(r['apply_lib'])} / {ms(r['apply_torch'])} / {ms(r['apply_engine'])} |")
    return "\n".join(lines) + (
        f"\n\nSmolLM2's tokenizer ({vocab} tokens), {threads} thread(s). Compile: a fresh compiler without cache, "
        f"median of 3 (llguidance compiles lazily: its matcher is built here, the rest happens in the first fills, "
        f"hence its mean and max). Fill: a matcher walking a {len(doc_ids)}-token document valid for the schema "
        f"(compact JSON); b=32: 32 matchers at spread positions, one batched library call per step "
        f"(xgrammar BatchGrammarMatcher, llguidance LLExecutor; in brackets one call per matcher). Apply: the 32 "
        f"masks of the last step on [32, V] float32 logits with the library's kernel (llguidance's is "
        f"torch.compile'd, so its column shows the torch-ops form), plain torch ops (unpack the bits, masked_fill), "
        f"and the engine's `apply_bitmask` (xgrammar's kernel for mostly-allowed rows; fill-and-restore for rows "
        f"that allow few tokens).")


# --------------------------------------------------------------------------------------------- engine
def decode_run(engine: Engine, prompts, params) -> dict:
    """All prompts at once; every step timed. Pure decode steps: all sequences running, no prompt token."""
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"so-{time.monotonic_ns()}-{i}")
    before = engine.stats()
    steps, outs, t_start = [], [], time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = engine.stats()
        t0, c0 = time.perf_counter(), time.process_time()
        outs.extend(engine.step())
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        s1 = engine.stats()
        if s1.num_running == len(prompts) and s1.prompt_tokens_total == s0.prompt_tokens_total:
            steps.append((dt, cpu, s1.structured_fill_seconds - s0.structured_fill_seconds,
                          s1.structured_apply_seconds - s0.structured_apply_seconds,
                          s1.structured_accept_seconds - s0.structured_accept_seconds))
    wall = time.perf_counter() - t_start
    after = engine.stats()
    tokens = after.generation_tokens_total - before.generation_tokens_total
    finish = {o.outputs[0].finish_reason for o in outs}
    assert finish == {"length"}, f"a sequence finished early: {finish}"
    steps = steps[1:] or steps
    cols = ("step", "cpu", "fill", "apply", "accept")
    return {"tps": tokens / wall, **{k: median([s[i] for s in steps]) for i, k in enumerate(cols)},
            "text": outs[0].outputs[0].text}


def throughput_table(engine: Engine, args) -> tuple[str, float]:
    prompts = text_prompts(engine.tokenizer, args.batch, args.input_len)
    plain = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len, structured_outputs={"json": RECORDS})
    decode_run(engine, prompts[:4], SamplingParams(temperature=0, max_tokens=4, structured_outputs={
        "json": RECORDS}))  # warm-up: tokenizer info, compile
    runs = {"unconstrained": [], "json_schema": []}
    for _ in range(args.repeats):
        for name, params in (("unconstrained", plain), ("json_schema", constrained)):
            runs[name].append(decode_run(engine, prompts, params))
    med = {name: {k: median([r[k] for r in rs]) for k in ("tps", "step", "cpu", "fill", "apply", "accept")}
           for name, rs in runs.items()}
    base, so = med["unconstrained"], med["json_schema"]
    ratio, cpu_ratio = base["step"] / so["step"], base["cpu"] / so["cpu"]
    lines = [f"| decoding | output tok/s | decode step (batch {args.batch}): wall / CPU | vs unconstrained: wall / "
             "CPU | fill / apply / accept per step | of the step (CPU) |", "|---|---:|---:|---:|---:|---:|"]
    for name, m in med.items():
        work = m["fill"] + m["apply"] + m["accept"]
        parts = (f"{m['fill'] * 1e3:.2f} / {m['apply'] * 1e3:.2f} / {m['accept'] * 1e3:.2f} ms | "
                 f"{100 * work / m['cpu']:.1f}%" if name == "json_schema" else "- | -")
        lines.append(f"| {name} | {m['tps']:.1f} | {m['step'] * 1e3:.1f} / {m['cpu'] * 1e3:.1f} ms | "
                     f"{base['step'] / m['step']:.3f}x / {base['cpu'] / m['cpu']:.3f}x | {parts} |")
    sample = runs["json_schema"][0]["text"][:160].replace("|", "\\|").replace("\n", "\\n")
    body = "\n".join(lines) + (
        f"\n\nSmolLM2-135M-Instruct (float32), {args.batch} real-text prompts of {args.input_len} tokens decoded "
        f"together, {args.output_len} new tokens each, greedy; unconstrained with ignore_eos, json_schema under an "
        f"array of at least 200 records (so no sequence finishes early; every run ends on 'length'); prefix caching "
        f"off; {args.repeats} alternating repeats, medians. Decode step: the median step with all {args.batch} "
        f"running and no prompt token, in wall time and in this process's CPU time (on a shared machine the wall time "
        f"also counts waiting for a core; the CPU time does not); fill / apply / accept: the structured-output work "
        f"inside those steps (xgrammar's batched bitmask fill, `apply_bitmask` over the constrained rows, matcher "
        f"accept; 'of the step': their sum, in wall time, over the CPU step, an upper bound). Decode throughput of json_schema relative to unconstrained: {ratio:.3f}x by wall time, "
        f"{cpu_ratio:.3f}x by CPU time (target >= 0.85x). A constrained sample: `{sample}`")
    return body, min(ratio, cpu_ratio)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-libraries", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/results/structured_outputs.md")
    args = ap.parse_args()
    configure_threads(args.threads, wait_policy="passive")
    t0 = time.perf_counter()
    engine = Engine(model="smollm2", dtype="float32", device="cpu", max_num_seqs=64, max_num_batched_tokens=2048,
                    max_model_len=2048, enable_prefix_caching=False)
    vocab = engine.model_config.vocab_size
    eos = sorted(set(engine.model_config.eos_token_ids) | {engine.tokenizer.eos_token_id})
    libs = "" if args.skip_libraries else libraries_table(engine.tokenizer, vocab, eos, args.threads)
    tput, ratio = throughput_table(engine, args)
    body = (f"### Grammar libraries\n\n{libs}\n\n" if libs else "") + f"### Decode cost at batch {args.batch}\n\n" \
        + tput + f"\n\n{args.threads} thread(s); {time.perf_counter() - t0:.0f} s."
    print(body)
    if not args.no_write:
        write_section("Structured outputs (grammar library; decode cost at batch 32)",
                      ("python -m bench.structured_outputs " + " ".join(sys.argv[1:])).strip(), body,
                      RESULTS / "structured_outputs.md")
    if ratio < 0.85:
        print(f"WARNING: structured decoding at {ratio:.3f}x of unconstrained, below the 0.85x target")


if __name__ == "__main__":
    main()

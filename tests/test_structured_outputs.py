"""Structured outputs in the engine (engine/structured.py) on a tiny random Llama with SmolLM2's real tokenizer
(49152 tokens), so the grammars meet a realistic vocabulary and the random logits make every sample a stress test.

Independent checks: the batched mask against the library's own matcher token by token; outputs at temperature 1
against `jsonschema`, `re.fullmatch` and the choice list; and the same under n > 1, stop strings, min_tokens,
preemption (recompute and swap) and Kara rounds. Every engine checks its allocator invariants after each step.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.sequence import Sequence
from engine.structured import GrammarState, StructuredOutputs, StructuredOutputsParams, apply_bitmask
from server_fixtures import build_engine, tiny_server_model_dir  # noqa: F401

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev extra")
xgr = pytest.importorskip("xgrammar", reason="xgrammar is installed by make install")

# Bounded strings and arrays, enums, integers and booleans: random logits finish it in a few dozen tokens.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "role": {"enum": ["admin", "editor", "viewer"]},
                         "active": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
          "required": ["name", "age", "role", "active", "tags"], "additionalProperties": False}
COMPACT = {"json": SCHEMA, "disable_any_whitespace": True}
REGEX = r"[A-Z][a-z]{1,6} \d{2,4}(-[a-f0-9]{3})?"
CHOICES = ["yes please", "no thanks", "maybe later", "ok"]
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
KARA = {"method": "kara", "window": 16, "buffer": 8, "ratio": 0.5, "chunk_max": 4, "chunk_budget": 2,
        "compression_period": 8}


@pytest.fixture(scope="module")
def engine(tiny_server_model_dir):  # noqa: F811
    eng = build_engine(tiny_server_model_dir)
    yield eng
    eng.shutdown()
    eng.check_invariants()


def run(eng, spec, seeds, prompt="Hello", **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 1.0)
    params = [SamplingParams(seed=s, structured_outputs=spec, **kw) for s in seeds]
    return [o.outputs for o in eng.generate([prompt] * len(params), params, use_tqdm=False)]


def valid_json(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


# ------------------------------------------------------------------------------------------- the mask
def fake_seq(compiled, outputs: list[int], min_tokens: int = 0) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(min_tokens=min_tokens, max_tokens=100))
    seq.structured = GrammarState(xgr.GrammarMatcher(compiled))
    seq.output_token_ids = list(outputs)
    return seq


def library_allowed(compiled, outputs: list[int], vocab: int) -> set[int]:
    """The tokens the library's own matcher accepts after `outputs`, asked one token at a time."""
    m = xgr.GrammarMatcher(compiled)
    for t in outputs:
        assert m.accept_token(t)
    allowed = set()
    for t in range(vocab):
        if m.accept_token(t):
            allowed.add(t)
            m.rollback(1)
    return allowed


def test_batched_mask_equals_the_librarys_matcher_and_leaves_other_rows_alone(engine):
    core = engine.core
    so = StructuredOutputs(core.tokenizer, core.model_config.vocab_size, core.eos_token_ids)
    compiled = so.compile(StructuredOutputsParams(**COMPACT))
    doc = json.dumps({"name": "Ada", "age": 36, "role": "editor", "active": True, "tags": ["x"]},
                     separators=(",", ":"))
    ids = core.tokenizer(doc, add_special_tokens=False).input_ids
    vocab = core.model_config.vocab_size
    # rows: constrained at several points of the document (start, inside a string, after a key, complete) and
    # one unconstrained row in the middle
    cuts = [0, 3, 6, len(ids)]
    seqs = [fake_seq(compiled, ids[:c]) for c in cuts[:2]] + [Sequence("u", [1], SamplingParams())]
    seqs += [fake_seq(compiled, ids[:c]) for c in cuts[2:]]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(seqs), vocab, generator=gen)
    before = logits.clone()
    so.mask(seqs, logits)
    assert torch.equal(logits[2], before[2])
    for row, cut in zip((0, 1, 3, 4), cuts):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == library_allowed(compiled, ids[:cut], vocab), f"row {row}"
        assert torch.equal(logits[row][list(finite)], before[row][list(finite)])  # kept logits untouched
    assert set(torch.isfinite(logits[4]).nonzero().flatten().tolist()) == core.eos_token_ids & set(range(vocab))


@pytest.mark.parametrize("vocab", [49152, 1000])
def test_apply_bitmask_equals_the_library_kernel_on_sparse_dense_and_mixed_rows(vocab):
    gen = torch.Generator().manual_seed(0)
    width = -(-vocab // 32)
    masks = [torch.randint(-2**31, 2**31 - 1, (width,), generator=gen, dtype=torch.int32),  # mixed words
             torch.zeros(width, dtype=torch.int32), torch.full((width,), -1, dtype=torch.int32)]
    few = torch.zeros(width, dtype=torch.int32)
    few[[0, 3, width - 1]] = torch.tensor([1, -1, 5], dtype=torch.int32)  # a few allowed, the padding bits too
    most = torch.full((width,), -1, dtype=torch.int32)
    most[[1, 7]] = torch.tensor([0, 12345], dtype=torch.int32)  # a few banned
    bitmask = torch.stack(masks + [few, most, masks[0]])
    logits = torch.randn(8, vocab, generator=gen)
    rows = [0, 1, 2, 3, 4, 6]  # row 5: unconstrained, its bitmask row ignored
    ours, ref = logits.clone(), logits.clone()
    apply_bitmask(ours, torch.cat([bitmask[:5], torch.zeros(1, width, dtype=torch.int32), bitmask[5:]]), rows,
                  vocab)
    xgr.apply_token_bitmask_inplace(ref, torch.cat([bitmask[:5], torch.zeros(1, width, dtype=torch.int32),
                                                    bitmask[5:]]), vocab_size=vocab, indices=rows)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[5], logits[5]) and torch.isfinite(ours[3]).sum() == 1 + 32 + 2


def test_a_complete_grammar_overrides_min_tokens_banning_eos(engine):
    """min_tokens bans EOS before the mask; where the grammar allows nothing else, the grammar wins (EOS comes
    back), so a row is never left without a token."""
    core = engine.core
    so = StructuredOutputs(core.tokenizer, core.model_config.vocab_size, core.eos_token_ids)
    compiled = so.compile(StructuredOutputsParams(choice=["ok"]))
    ids = core.tokenizer("ok", add_special_tokens=False).input_ids
    seqs = [fake_seq(compiled, ids, min_tokens=50), fake_seq(compiled, [], min_tokens=50)]
    logits = torch.randn(2, core.model_config.vocab_size, generator=torch.Generator().manual_seed(1))
    eos = sorted(core.eos_token_ids)
    logits[:, eos] = float("-inf")  # what apply_min_tokens did
    before = logits.clone()
    so.mask(seqs, logits)
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == set(eos)
    assert (logits[0, eos] == 0).all()
    allowed = torch.isfinite(logits[1]).nonzero().flatten()
    assert len(allowed) > 0 and not set(allowed.tolist()) & set(eos)
    assert torch.equal(logits[1, allowed], before[1, allowed])


def test_the_matcher_follows_outputs_that_shrink_or_grow(engine):
    """`sync` rolls the matcher back (or forward) to the sequence's outputs, so any future rollback of output
    tokens keeps the mask right."""
    core = engine.core
    so = StructuredOutputs(core.tokenizer, core.model_config.vocab_size, core.eos_token_ids)
    compiled = so.compile(StructuredOutputsParams(**COMPACT))
    ids = core.tokenizer('{"name":"Bob","age":7,', add_special_tokens=False).input_ids
    seq = fake_seq(compiled, ids)
    vocab = core.model_config.vocab_size
    for outputs in (ids, ids[:4], ids[:6], []):
        seq.output_token_ids = list(outputs)
        logits = torch.zeros(1, vocab)
        so.mask([seq], logits)
        fresh = torch.zeros(1, vocab)
        so.mask([fake_seq(compiled, outputs)], fresh)
        assert torch.equal(torch.isfinite(logits), torch.isfinite(fresh))
        assert seq.structured.num_accepted == len(outputs)


def test_the_grammar_starts_after_the_reasoning_end_marker(engine):
    """With ``after`` (the server's reasoning end marker) the row samples freely until the marker's tokens have
    been generated, then the mask is the library's for the tokens past the marker alone; a marker that arrives
    one token per step is still found, and outputs that shrink below it free the row again."""
    core = engine.core
    so = StructuredOutputs(core.tokenizer, core.model_config.vocab_size, core.eos_token_ids)
    compiled = so.compile(StructuredOutputsParams(**COMPACT))
    vocab = core.model_config.vocab_size
    marker = (11, 12)
    json_ids = core.tokenizer('{"name":"Bo', add_special_tokens=False).input_ids
    seq = fake_seq(compiled, [])
    seq.structured = GrammarState(xgr.GrammarMatcher(compiled), after=marker)
    for outputs, start in (([5, 11], None), ([5, 11, 7], None), ([5, 11, 7, 11], None),
                           ([5, 11, 7, 11, 12], 5), ([5, 11, 7, 11, 12, *json_ids], 5), ([5, 11], None)):
        seq.output_token_ids = list(outputs)
        logits = torch.zeros(1, vocab)
        so.mask([seq], logits)
        assert seq.structured.start == start
        if start is None:
            assert torch.isfinite(logits).all()  # still reasoning: nothing masked
        else:
            fresh = torch.zeros(1, vocab)
            so.mask([fake_seq(compiled, outputs[start:])], fresh)
            assert torch.equal(torch.isfinite(logits), torch.isfinite(fresh))
            assert seq.structured.num_accepted == len(outputs) - start
    with pytest.raises(InvalidRequestError):  # requests cannot set it
        StructuredOutputsParams.coerce({"json": SCHEMA, "after": [1]})


def test_choice_literals_are_escaped(engine):
    core = engine.core
    so = StructuredOutputs(core.tokenizer, core.model_config.vocab_size, core.eos_token_ids)
    choices = ['say "hi"', "back\\slash", "é ü", "tab\tx"]
    compiled = so.compile(StructuredOutputsParams(choice=choices))
    wrong = ['say \\"hi\\"', "\\u00e9 ü", "say"]  # escapes taken literally, a prefix
    for text, ok in [(c, True) for c in choices] + [(w, False) for w in wrong]:
        m = xgr.GrammarMatcher(compiled)
        assert (m.accept_string(text) and m.is_completed()) == ok, text


# ------------------------------------------------------------------------------------------- outputs
def test_json_schema_every_seeded_sample_at_temperature_1_validates(engine):
    outs = run(engine, COMPACT, range(24))
    for (o,) in outs:
        assert o.finish_reason == "stop", o.text
        valid_json(o.text)
    assert len({o.text for (o,) in outs}) > 20  # really sampled


def test_default_whitespace_still_validates_when_it_finishes(engine):
    """With vLLM's default (any whitespace between JSON tokens) random logits may pad for long; every sample
    that finishes must still validate."""
    outs = run(engine, {"json": json.dumps(SCHEMA)}, range(8), max_tokens=120)
    for (o,) in outs:
        if o.finish_reason == "stop":
            valid_json(o.text)


def test_regex_choice_and_grammar_hold(engine):
    for (o,) in run(engine, {"regex": REGEX}, range(12)):
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    texts = [o.text for (o,) in run(engine, {"choice": CHOICES}, range(12))]
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1
    for (o,) in run(engine, {"grammar": GRAMMAR}, range(12)):
        assert o.finish_reason == "stop" and re.fullmatch(r"\(([1-9][0-9]?)(\+[1-9][0-9]?)*\)", o.text), o.text


def test_json_object_outputs_that_finish_parse_as_objects(engine):
    """Free-form JSON: random logits rarely close a string, so only some seeds finish inside max_tokens; those
    must parse as objects (the schema tests above cover validity on every sample)."""
    outs = run(engine, {"json_object": True, "disable_any_whitespace": True}, range(16), max_tokens=96)
    finished = [o.text for (o,) in outs if o.finish_reason == "stop"]
    assert finished
    for text in finished:
        assert isinstance(json.loads(text), dict)
    assert all(o.text.startswith("{") for (o,) in outs)


def test_n_greater_than_one_each_sequence_has_its_own_matcher(engine):
    (outs,) = run(engine, COMPACT, [7], n=6)
    assert len(outs) == 6 and len({o.text for o in outs}) == 6
    for o in outs:
        assert o.finish_reason == "stop"
        valid_json(o.text)


def test_stop_strings_cut_the_constrained_text(engine):
    for (o,) in run(engine, {"choice": CHOICES}, range(8), stop=[" "]):
        assert o.text in {c.split(" ")[0] for c in CHOICES}
        assert o.finish_reason == "stop" and (o.stop_reason == " " or o.text == "ok")
    for (o,) in run(engine, COMPACT, range(4), stop=[","]):
        assert o.stop_reason == "," and o.text.startswith('{"name":"') and "," not in o.text


def test_the_grammar_ends_the_sequence_even_with_min_tokens_or_ignore_eos(engine):
    for kw in ({"min_tokens": 30}, {"ignore_eos": True}):
        for (o,) in run(engine, {"choice": CHOICES}, range(6), max_tokens=60, **kw):
            assert o.text in CHOICES and o.finish_reason == "stop" and len(o.token_ids) < 10, (kw, o)


def test_greedy_is_the_argmax_among_allowed_tokens(engine):
    a = run(engine, COMPACT, [0, 1], temperature=0)
    assert a[0][0].text == a[1][0].text
    valid_json(a[0][0].text)


# ------------------------------------------------------------------------------- preemption and Kara rounds
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_valid_under_preemption_in_a_tiny_pool(tiny_server_model_dir, mode):  # noqa: F811
    eng = build_engine(tiny_server_model_dir, num_kv_blocks=10, max_model_len=128, preemption_mode=mode,
                       compress_before_preempt=False, enable_prefix_caching=False)
    try:
        prompt = list(range(100, 124))
        outs = run(eng, COMPACT, range(8), prompt=prompt, max_tokens=100)
        s = eng.stats()
        assert s.num_preemptions > 0 and (s.swapped_out_blocks > 0) == (mode == "swap")
        for (o,) in outs:
            assert o.finish_reason == "stop"
            valid_json(o.text)
    finally:
        eng.shutdown()


def test_forced_swap_and_recompute_mid_json_keep_the_matcher_in_step(tiny_server_model_dir):  # noqa: F811
    eng = build_engine(tiny_server_model_dir)
    try:
        params = [SamplingParams(seed=s, temperature=1.0, max_tokens=200, structured_outputs=COMPACT)
                  for s in range(4)]
        reqs = [eng.new_request("Hello", p) for p in params]
        for r in reqs:
            eng.add_request(r)
        for _ in range(8):
            eng.step()
        for r, swap in zip(reqs[:2], (True, False)):
            seq = r.seqs[0]
            assert not seq.is_finished and seq.num_outputs > 0
            eng.core.scheduler.preempt(seq, swap=swap)
        while eng.has_unfinished_requests():
            eng.step()
        assert eng.stats().num_preemptions == 2 and eng.stats().swapped_in_blocks > 0
        assert [r.seqs[0].num_preemptions for r in reqs] == [1, 1, 0, 0]
        for r in reqs:
            assert r.final.outputs[0].finish_reason == "stop"
            valid_json(r.final.outputs[0].text)
    finally:
        eng.shutdown()


def test_valid_while_kara_rounds_compress_mid_generation(tiny_server_model_dir):  # noqa: F811
    eng = build_engine(tiny_server_model_dir, kv_compression=KARA)
    try:
        prompt = list(range(200, 240))
        outs = run(eng, COMPACT, range(8), prompt=prompt)
        assert eng.stats().compression.rounds > 0
        for (o,) in outs:
            assert o.finish_reason == "stop"
            valid_json(o.text)
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("spec,param", [
    ({"json": {"type": "bogus"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"grammar": 'root ::= "a" missing'}, "structured_outputs.grammar"),
    ({"regex": "a(b", "param": "guided_regex"}, "guided_regex"),
    ({"json": {"type": "bogus"}, "param": "response_format.json_schema"}, "response_format.json_schema"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"regex": "a", "typo": 1}, "structured_outputs.typo"),
])
def test_a_rejected_spec_names_its_field(engine, spec, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(["Hello"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert err.value.param == param, str(err.value)
    assert "project/cpp" not in str(err.value)  # the library's sentence, not its C++ location
    engine.check_invariants()


def test_lossless_mode_is_refused_with_structured_outputs(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(["Hello"], SamplingParams(structured_outputs={"regex": "a+"},
                                                  kv_compression={"method": "kara", "lossless": True}),
                        use_tqdm=False)
    assert err.value.param == "structured_outputs.regex" and "lossless" in str(err.value)


def test_an_unmasked_token_fails_its_request_and_the_engine_goes_on(engine, monkeypatch):
    """With the mask broken (not applied) the sampled tokens leave the grammar: the matcher rejects them, that
    request fails alone, and the checks above would fail (run them with the same patch to see it)."""
    with monkeypatch.context() as m:
        m.setattr(StructuredOutputs, "mask", lambda self, seqs, logits: [])
        with pytest.raises(RuntimeError, match="rejected token"):
            run(engine, COMPACT, [0])
    (o,) = run(engine, COMPACT, [0])[0]
    valid_json(o.text)
    engine.check_invariants()

"""Defence in depth: a fault in one request's own part of a step (its scheduling, its state, its compaction job, its
compression round, its sampling) fails that request alone; the others finish with exactly the outputs they have
without it, and the engine stays healthy. Only a failure of the batched forward itself may stop the loop."""
from __future__ import annotations

import pytest

import compression.stage as stage_module
import engine.sampler as sampler_module
from engine import SamplingParams
from engine.errors import RequestFailedError

KARA = {"method": "kara", "window": 16, "buffer": 4, "ratio": 0.3, "chunk_budget": 2, "compression_period": 12}
THRESHOLD = {"method": "threshold", "threshold_max": 40, "threshold_target": 24, "observation_window": 4}
INFOKV = {"method": "infokv", "window": 16, "buffer": 4, "ratio": 0.3, "compression_period": 12}
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12, 13, 14, 15], "c": [20, 21, 22, 23]}


def _params(setting, **kw):
    return SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, kv_compression=setting, **kw)


def _run(eng, reqs):
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished_requests():
        eng.step()  # a request's own fault must never escape the step
    return reqs


def _victim_seq(victim):
    return victim.seqs[0]


def _fault_scheduling(eng, victim, monkeypatch):
    real = eng.core.kv.allocate_slots

    def allocate(seq, *args, **kw):
        if seq is _victim_seq(victim) and seq.num_outputs >= 5:
            raise RuntimeError("injected: allocation")
        return real(seq, *args, **kw)

    monkeypatch.setattr(eng.core.kv, "allocate_slots", allocate)


def _fault_query_store(eng, victim, monkeypatch):
    queries = _victim_seq(victim).compression.queries
    real = queries.store

    def store(first, q):
        if first > 20:
            raise MemoryError("injected: query cache")
        return real(first, q)

    monkeypatch.setattr(queries, "store", store)


def _fault_compaction_job(eng, victim, monkeypatch):
    real = eng.core.kv.gather_keys

    def gather(seq, *args):
        if seq is _victim_seq(victim):
            raise RuntimeError("injected: gather")
        return real(seq, *args)

    monkeypatch.setattr(eng.core.kv, "gather_keys", gather)


def _fault_window_selection(eng, victim, monkeypatch):
    comp = eng.core.stage.compressor(_victim_seq(victim).compression.config)
    gen = _victim_seq(victim).compression.rng()
    real = type(comp).select_windows

    def select(self, batch):
        if any(g is gen for g in batch.generators):  # the victim's windows are in this (batched) call
            raise ValueError("injected: selection")
        return real(self, batch)

    monkeypatch.setattr(type(comp), "select_windows", select)


def _fault_threshold_selection(eng, victim, monkeypatch):
    comp = eng.core.stage.compressor(_victim_seq(victim).compression.config)
    real = type(comp).select_threshold

    def select(self, batch):
        if batch.slot_state is _victim_seq(victim).compression.slot_state:
            raise ValueError("injected: threshold selection")
        return real(self, batch)

    monkeypatch.setattr(type(comp), "select_threshold", select)


def _fault_entropy(eng, victim, monkeypatch):
    real = stage_module._record_entropy

    def record(seqs, logits, k, rows):
        if any(seqs[r] is _victim_seq(victim) for r in rows):
            raise RuntimeError("injected: entropy")
        return real(seqs, logits, k, rows)

    monkeypatch.setattr(stage_module, "_record_entropy", record)


def _fault_sampling(eng, victim, monkeypatch):
    real = sampler_module.sample

    def sample(logits, params, *args):
        if any(p is victim.params for p in params) and _victim_seq(victim).num_outputs >= 3:
            raise RuntimeError("injected: sampling")
        return real(logits, params, *args)

    monkeypatch.setattr(sampler_module, "sample", sample)


CASES = [  # (fault, compression setting of every request, where the victim's error says it failed)
    (_fault_scheduling, KARA, "scheduling"),
    (_fault_query_store, KARA, "storing its queries"),
    (_fault_compaction_job, KARA, "its compression round"),
    (_fault_window_selection, KARA, "its compression round"),
    (_fault_threshold_selection, THRESHOLD, "its compression round"),
    (_fault_entropy, INFOKV, "recording its sampling entropy"),
    (_fault_sampling, KARA, "sampling"),
]


@pytest.mark.parametrize("fault,setting,where", CASES, ids=[c[0].__name__[7:] for c in CASES])
def test_a_fault_in_one_requests_part_fails_it_alone(make_engine, monkeypatch, fault, setting, where):
    eng = make_engine()
    alone = {rid: _run(eng, [eng.new_request(p, _params(setting), f"ref-{rid}")])[0].final.outputs[0].token_ids
             for rid, p in PROMPTS.items()}
    victim_params = _params(setting) if fault is not _fault_sampling else SamplingParams(
        temperature=0.8, seed=3, max_tokens=48, ignore_eos=True, kv_compression=setting)
    victim = eng.new_request([30, 31, 32, 33, 34], victim_params, "victim")
    others = [eng.new_request(p, _params(setting), rid) for rid, p in PROMPTS.items()]
    fault(eng, victim, monkeypatch)
    _run(eng, [victim, *others])
    assert isinstance(victim.error, RequestFailedError) and victim.error.where == where, victim.error
    assert "injected" in str(victim.error) and victim.done.is_set()
    for r in others:
        assert r.error is None and r.final.outputs[0].token_ids == alone[r.request_id]
    assert eng.is_healthy()
    assert eng.stats().compression.rounds > 0


def test_a_fault_in_the_batched_forward_still_stops_the_loop(make_engine, monkeypatch):
    """The one failure that is not a request's own: the batch's forward pass (every request in it is affected)."""
    eng = make_engine()

    def broken(*args, **kw):
        raise RuntimeError("injected: device failure")

    monkeypatch.setattr(eng.core.runner, "execute", broken)
    eng.add_request(eng.new_request([5, 6, 7], _params(None), "x"))
    with pytest.raises(RuntimeError, match="device failure"):
        eng.step()
    monkeypatch.undo()
    eng.abort("x")
    eng.step()

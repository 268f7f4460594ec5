"""Every registered compression method in the serving loop (tiny random Llama, invariants checked after every step
by the `make_engine` fixture): periodic and threshold policies with preemptions and aborts, r = 1 equal to no
compression, per-method statistics adding up to the totals, and the side signals and state that flow through the
stage, each checked against an independent derivation: InfoKV's sampling entropy (from the top-k log-probs the
sampler reports), its per-slot copy under the threshold policy (slot positions tracked through the compactions and
tied to the cached keys), AMS's EMA credit across threshold events and preemption, and the centroids CentroidKV
writes into the cache (plain float64 means of the original K/V)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from compression import KVCompressionConfig, registry
from compression.ams import AMSCompressor, ams_credit_update, ams_threshold_mass
from compression.centroid import CentroidCompressor, centroid_clusters
from compression.infokv import InfoKVCompressor, infokv_select
from engine import SamplingParams
from helpers_engine import run_with_random_aborts

PERIODIC = dict(window=16, buffer=4, ratio=0.25, compression_period=12)  # n = 12, ⌈0.25 · 12⌉ = 3 kept
THRESHOLD = dict(policy="threshold", threshold_max=32, threshold_target=20, observation_window=4)
# Method parameters that make the tiny windows interesting (AMS: several segments in 12 slots; Kara's family: an
# α that leaves something to evict).
EXTRA = {"chunk_max": 4, "chunk_budget": 2, "segment_mass": 0.2, "min_seg_len": 2, "max_seg_len": 6,
         "min_keep_per_segment": 1, "n_sink": 1, "keep_last": 2, "chunk_size": 4}


def methods(policy: str) -> list[str]:
    return [m for m in registry.names() if m != "none" and policy in registry.get(m).policies]


def config(method: str, policy: str = "periodic", **kw) -> dict:
    names = registry.get(method).param_names()
    base = PERIODIC if policy == "periodic" else THRESHOLD
    return {"method": method, **base, **{k: v for k, v in EXTRA.items() if k in names}, **kw}


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def run_until_done(eng, req, on_step=None):
    while not req.done.is_set():
        eng.step()
        if on_step is not None:
            on_step()


def test_every_method_is_registered_with_a_parameter_record():
    # the methods the issue names, each with a parameter record and validate(); those with parameters their own
    # dataclass, the parameterless ones the shared NoParams
    for m in ("rkv", "ams", "infokv", "centroid", "snapkv", "tova", "h2o", "keydiff", "knorm", "streaming", "kara",
              "threshold"):
        spec = registry.get(m)
        assert hasattr(spec.params, "validate") and (spec.params.__name__ != "NoParams") == bool(spec.param_names()), m
    for m in ("rkv", "ams", "infokv", "snapkv", "tova", "h2o", "keydiff", "knorm"):
        assert registry.get(m).policies == ("periodic", "threshold"), m
    assert registry.get("centroid").policies == ("periodic",)
    assert registry.get("threshold").policies == ("threshold",)
    # methods without Kara's α keep ⌈r·n⌉ per window
    for m in ("rkv", "ams", "infokv", "centroid", "snapkv", "tova", "h2o", "keydiff", "knorm"):
        assert KVCompressionConfig(m, ratio=0.3, window=512, buffer=64).kept_per_window == 135, m


@pytest.mark.parametrize("method,policy", [(m, "periodic") for m in methods("periodic")]
                         + [(m, "threshold") for m in methods("threshold")])
def test_every_method_runs_with_preemptions_and_aborts(make_engine, method, policy):
    # a pool for ~3 of the 8 sequences: preemptions (recompute for the threshold policy, whose per-slot state must
    # then be dropped), aborts every 13 steps, invariants after every step
    extra = {"preemption_mode": "recompute"} if policy == "threshold" else {}
    eng = make_engine(kv_compression=config(method, policy), num_kv_blocks=28, watermark=0, max_num_seqs=8, **extra)
    reqs = run_with_random_aborts(eng, random.Random(hash(method) % 1000), 8, (3, 16), (20, 70), abort_every=13)
    st = eng.stats()
    assert st.num_preemptions > 0
    assert st.compression.by_method[method].rounds > 0 and st.compression.tokens_evicted > 0
    assert any(r.final.outputs[0].finish_reason == "abort" for r in reqs)
    for req in reqs:
        o = req.final.outputs[0]
        assert o.finish_reason in ("length", "abort")
        if o.finish_reason == "length":
            assert len(o.token_ids) == req.params.max_tokens


def test_ratio_one_is_identical_to_no_compression_for_every_method(make_engine):
    """Every method at r = 1, all in one batch (rounds mixing methods), each output equal to the uncompressed one."""
    prompts = [list(range(5, 25)), list(range(60, 70))]
    eng = make_engine(max_num_seqs=64)
    ref = [o.outputs[0].token_ids for o in eng.generate(prompts, greedy(50), use_tqdm=False)]
    names = methods("periodic")
    params = [greedy(50, kv_compression=config(m, ratio=1.0)) for m in names for _ in prompts]
    outs = eng.generate([p for _ in names for p in prompts], params, use_tqdm=False)
    for i, m in enumerate(names):
        assert [o.outputs[0].token_ids for o in outs[2 * i:2 * i + 2]] == ref, m
        assert eng.stats().compression.by_method[m].rounds >= 3, m
    assert eng.stats().compression.tokens_evicted == 0


def test_per_method_stats_add_up_to_the_totals(make_engine):
    eng = make_engine(num_kv_blocks=512, max_num_seqs=64)
    runs = [(m, "periodic") for m in methods("periodic")] + [(m, "threshold") for m in methods("threshold")]
    reqs = []
    for i, (m, policy) in enumerate(runs):  # all at once: rounds mixing methods
        req = eng.new_request(list(range(5, 25)), greedy(44, kv_compression=config(m, policy)), f"q{i}")
        eng.add_request(req)
        reqs.append(req)
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats()
    by = {name: r.as_dict() for name, r in st.compression.by_method.items()}
    assert set(by) == {m for m, _ in runs}
    for key, total in (("tokens_seen", st.compression.tokens_seen), ("tokens_evicted", st.compression.tokens_evicted),
                       ("tokens_merged", st.compression.tokens_merged),
                       ("blocks_freed", st.compression.blocks_freed)):
        assert sum(v[key] for v in by.values()) == total > 0, key
    assert sum(v["seconds"] for v in by.values()) == pytest.approx(st.compression.seconds, rel=1e-9, abs=1e-12)
    rounds = [v["rounds"] for v in by.values()]
    assert max(rounds) <= st.compression.rounds < sum(rounds)  # rounds mixed methods
    # independent token accounting from each sequence's own frontier and event count: a periodic round takes whole
    # regions of n = 12 and keeps K of each; a threshold event scores the T - w = 28 slots before the observation
    # window and keeps N - w = 16
    expect = {m: [0, 0] for m, _ in runs}
    for (m, policy), req in zip(runs, reqs):
        st = req.seqs[0].compression
        if policy == "periodic":
            seen = st.compressed_tokens - st.start
            K = KVCompressionConfig(**config(m)).kept_per_window
            expect[m][0] += seen
            expect[m][1] += seen // 12 * (12 - K)
        else:
            expect[m][0] += 28 * st.rounds
            expect[m][1] += 12 * st.rounds
    for m, (seen, evicted) in expect.items():
        assert (by[m]["tokens_seen"], by[m]["tokens_evicted"]) == (seen, evicted), m
        assert by[m]["tokens_merged"] == (evicted if m == "centroid" else 0), m


# ---------------------------------------------------------------------------------------------- InfoKV entropy
def ref_topk_entropy(entry: dict[int, float], k: int) -> float:
    """Top-k renormalised entropy from the sampler's reported log-probs (float64)."""
    top = sorted(entry.values(), reverse=True)[:k]
    z = sum(math.exp(v) for v in top)
    ps = [math.exp(v) / z for v in top]
    return -sum(p * math.log(p) for p in ps if p > 0)


def entropy_by_position(seq) -> list[float]:
    """NaN for the prompt, then the reference entropy of each output's sampling distribution."""
    return [math.nan] * seq.num_prompt_tokens + [ref_topk_entropy(e, 10) for e in seq.logprobs]


def test_entropy_is_recorded_at_sampling_by_logical_position(make_engine):
    eng = make_engine(kv_compression=config("infokv"))
    req = eng.new_request(list(range(5, 25)), greedy(30, logprobs=10), "e")
    eng.add_request(req)
    other = eng.new_request(list(range(30, 40)), greedy(30, kv_compression="none"), "n")
    eng.add_request(other)
    seq = req.seqs[0]
    run_until_done(eng, req)
    while eng.has_unfinished_requests():
        eng.step()
    got = seq.compression.entropy.get(0, seq.num_tokens + 1)
    exp = torch.tensor(entropy_by_position(seq) + [math.nan], dtype=torch.float64)
    torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert other.seqs[0].compression is None  # nothing recorded for a sequence whose method does not ask


def test_infokv_window_gets_the_entropies_of_its_tokens(make_engine, monkeypatch):
    seen = []
    real = InfoKVCompressor.select_windows
    monkeypatch.setattr(InfoKVCompressor, "select_windows",
                        lambda self, batch: seen.append((batch, real(self, batch))) or seen[-1][1])
    eng = make_engine(kv_compression=config("infokv"))
    req = eng.new_request(list(range(5, 25)), greedy(60, logprobs=10), "w")
    eng.add_request(req)
    seq = req.seqs[0]
    starts = []
    before = [seq.compression.compressed_tokens]

    def note():
        if len(seen) > len(starts):
            starts.append(before[0])
        before[0] = seq.compression.compressed_tokens

    run_until_done(eng, req, note)
    assert len(seen) >= 3
    ent = torch.tensor(entropy_by_position(seq), dtype=torch.float32)
    L = eng.core.model_config.num_layers
    for (batch, kept), start in zip(seen, starts):
        rows = []
        for j in range(batch.num_windows):
            rows += [ent[start + j * 12:start + j * 12 + 16]] * L
        exp = torch.stack(rows)
        assert torch.isfinite(exp).all()  # generated tokens only: the prompt is not compressed
        torch.testing.assert_close(batch.entropy, exp, rtol=1e-4, atol=1e-5)
        ref = infokv_select(batch.queries, batch.keys, 12, 3, exp)
        assert torch.equal(kept, ref)


def _tracked_threshold_run(eng, req, capture, on_event):
    """Step `req` to completion; after each step that ran a threshold event, call on_event(batch, selection,
    num_computed_tokens) with what the spy `capture` (a list) recorded for it."""
    seq = req.seqs[0]
    done = 0

    def note():
        nonlocal done
        while done < len(capture):
            on_event(*capture[done], seq.num_computed_tokens)
            done += 1

    run_until_done(eng, req, note)
    return done


def test_infokv_threshold_entropy_follows_its_slots_through_compaction(make_engine, monkeypatch):
    capture = []
    real = InfoKVCompressor.select_threshold
    monkeypatch.setattr(InfoKVCompressor, "select_threshold",
                        lambda self, b: capture.append((b, real(self, b))) or capture[-1][1])
    eng = make_engine(kv_compression=config("infokv", "threshold"))
    req = eng.new_request(list(range(5, 15)), greedy(70, logprobs=10), "t")
    eng.add_request(req)
    seq = req.seqs[0]
    state = {"pos": None, "keys": None}  # logical position of every slot, per (layer, KV head); expected keys

    def on_event(batch, kept, computed):
        L, hkv, T, _ = batch.keys.shape
        ent = torch.tensor(entropy_by_position(seq) + [math.nan] * 4, dtype=torch.float32)
        if state["pos"] is None:
            pos = torch.arange(T).expand(L, hkv, T)
        else:  # slots appended since the last event are the newest positions
            old = state["pos"]
            pos = torch.cat([old, (state["next"] + torch.arange(T - old.shape[2])).expand(L, hkv, -1)], dim=2)
            # the tracked slots hold the keys the last event kept, in order: the tracking follows the cache
            assert torch.equal(batch.keys[:, :, :old.shape[2]], state["keys"])
        torch.testing.assert_close(batch.entropy, ent[pos], rtol=1e-4, atol=1e-5, equal_nan=True)
        keep = torch.cat([kept, torch.arange(T - 4, T).expand(L, hkv, 4)], dim=2)
        state["pos"], state["next"] = pos.gather(2, keep), computed
        state["keys"] = batch.keys.gather(2, keep[..., None].expand(-1, -1, -1, batch.keys.shape[3]))

    assert _tracked_threshold_run(eng, req, capture, on_event) >= 3
    assert torch.isfinite(capture[-1][0].entropy).any() and torch.isnan(capture[0][0].entropy).any()


def test_ams_credit_is_carried_between_threshold_events_and_dropped_by_recompute(make_engine, monkeypatch):
    capture = []
    real = AMSCompressor.select_threshold

    def spy(self, batch):
        prev = batch.slot_state.get("credit")
        out = real(self, batch)
        capture.append((batch, prev, out))
        return out

    monkeypatch.setattr(AMSCompressor, "select_threshold", spy)
    eng = make_engine(kv_compression=config("ams", "threshold"))
    req = eng.new_request(list(range(5, 15)), greedy(90), "a")
    eng.add_request(req)
    seq = req.seqs[0]
    events = 0
    preempted_at = None
    while not req.done.is_set():
        eng.step()
        if len(capture) == 3 and preempted_at is None and not seq.is_finished:
            eng.core.scheduler.preempt(seq, swap=False)  # the cache is rebuilt: the credit must go
            preempted_at = 3
        events = len(capture)
    assert events >= 5
    for i, (batch, prev, sel) in enumerate(capture):
        T, w = batch.keys.shape[2], 4
        if i == 0 or i == preempted_at:
            assert prev is None, i
        else:
            assert torch.equal(prev, capture[i - 1][2].slot_state["credit"]), i
        # independently: the EMA of this event's mass, taken at the kept slots then the window, in that order
        _, credit = ams_credit_update(ams_threshold_mass(batch.queries_obs, batch.keys), prev)
        keep = torch.cat([sel.kept, torch.arange(T - w, T).expand(*sel.kept.shape[:2], w)], dim=2)
        torch.testing.assert_close(sel.slot_state["credit"], credit.gather(2, keep))


def test_ams_without_credit_keeps_no_state(make_engine, monkeypatch):
    capture = []
    real = AMSCompressor.select_threshold
    monkeypatch.setattr(AMSCompressor, "select_threshold",
                        lambda self, b: capture.append(dict(b.slot_state)) or real(self, b))
    eng = make_engine(kv_compression=config("ams", "threshold", use_credit=False))
    eng.generate([list(range(5, 15))], greedy(60), use_tqdm=False)
    assert len(capture) >= 3 and all(c == {} for c in capture)


# ---------------------------------------------------------------------------------------------- merging
def test_centroids_are_written_into_the_kept_slots_window_by_window(make_engine, monkeypatch):
    seen = []
    real = CentroidCompressor.select_windows
    monkeypatch.setattr(CentroidCompressor, "select_windows",
                        lambda self, b: seen.append((b, real(self, b))) or seen[-1][1])
    eng = make_engine(kv_compression=config("centroid", compress_prompt=True))
    req = eng.new_request(list(range(4, 44)), greedy(2), "c")  # (40 - 4) // 12 = 3 windows in the first round
    eng.add_request(req)
    eng.step()
    seq = req.seqs[0]
    batch, sel = seen[0]
    L, hkv = batch.keys.shape[0] // 3, batch.keys.shape[1]
    K = 3
    assert batch.num_windows == 3 and seq.kv_len == 40 - 36 + 3 * K
    got_k = eng.core.kv.gather_keys(seq, 0, seq.kv_len)
    got_v = eng.core.kv.gather_values(seq, 0, seq.kv_len)
    for j in range(3):
        for l in range(L):
            r = j * L + l
            kept, owner = centroid_clusters(batch.keys[r:r + 1], 12, K, chunk_size=4)
            for h in range(hkv):
                for t, slot in enumerate(kept[0, h].tolist()):
                    members = [i for i in range(12) if owner[0, h, i] == slot]
                    for src, got in ((batch.keys, got_k), (batch.values, got_v)):
                        mean = src[r, h, members].double().mean(dim=0)
                        torch.testing.assert_close(got[l, h, j * K + t].double(), mean, rtol=1e-5, atol=1e-6)
    # the buffer of the last window (slots 36..39) follows the merged region unchanged
    last = slice(2 * L, 3 * L)
    assert torch.equal(got_k[:, :, 3 * K:], batch.keys[last, :, 12:])
    assert torch.equal(got_v[:, :, 3 * K:], batch.values[last, :, 12:])
    st = eng.stats()
    assert st.compression.tokens_merged == st.compression.tokens_evicted == 3 * (12 - K)
    run_until_done(eng, req)


def test_a_wrong_merge_order_would_be_caught(make_engine, monkeypatch):
    """The layout check above can fail: with the merged rows of each head reversed before the compaction writes
    them, the cache no longer holds the windows' centroids in order."""
    eng = make_engine(kv_compression=config("centroid", compress_prompt=True))
    real_compact = eng.core.kv.compact

    def scrambled(jobs):
        for job in jobs:
            if job.new_keys is not None:
                job.new_keys = job.new_keys.flip(2)
        return real_compact(jobs)

    monkeypatch.setattr(eng.core.kv, "compact", scrambled)
    seen = []
    real = CentroidCompressor.select_windows
    monkeypatch.setattr(CentroidCompressor, "select_windows",
                        lambda self, b: seen.append((b, real(self, b))) or seen[-1][1])
    req = eng.new_request(list(range(4, 44)), greedy(2), "c")
    eng.add_request(req)
    eng.step()
    batch, sel = seen[0]
    L = batch.keys.shape[0] // 3
    got = eng.core.kv.gather_keys(req.seqs[0], 0, 9)
    expected = torch.cat([sel.new_keys[j * L:(j + 1) * L] for j in range(3)], dim=2)
    assert not torch.equal(got, expected)
    run_until_done(eng, req)


def test_gather_values_reads_the_value_half_of_each_slot(make_engine):
    eng = make_engine()
    req = eng.new_request(list(range(5, 30)), greedy(3), "g")
    eng.add_request(req)
    eng.step()
    seq, kv = req.seqs[0], eng.core.kv
    data, bs = eng.core.kv_cache.data, kv.block_size
    for s in (0, 5, 17, seq.kv_len - 1):
        b, o = seq.block_table[s // bs], s % bs
        assert torch.equal(kv.gather_values(seq, s, 1)[:, :, 0], data[:, b, 1, o])
        assert torch.equal(kv.gather_keys(seq, s, 1)[:, :, 0], data[:, b, 0, o])
    run_until_done(eng, req)


# ---------------------------------------------------------------------------------------------- bad parameters
def _bad_values(method: str) -> list[tuple[str, object]]:
    return [(name, "x") for name in registry.get(method).param_names()]


@pytest.mark.parametrize("method", [m for m in registry.names() if m != "none"])
def test_every_parameter_rejects_a_bad_value_naming_it(method):
    from compression.config import ConfigError, coerce

    for name, value in _bad_values(method):
        with pytest.raises(ConfigError) as err:
            coerce({"method": method, name: value})
        assert err.value.param == f"kv_compression.{name}", (method, name)


@pytest.mark.parametrize("setting,param", [
    ({"method": "h2o", "num_recent": 4, "window": 16, "buffer": 4, "ratio": 0.25}, "num_recent"),  # keeps 3
    ({"method": "h2o", "policy": "threshold", "num_recent": 17, "threshold_target": 20, "observation_window": 4},
     "num_recent"),
    ({"method": "rkv", "obs_window": 5, "window": 16, "buffer": 4}, "obs_window"),
    ({"method": "snapkv", "obs_window": 2, "policy": "threshold"}, "obs_window"),
    ({"method": "ams", "base": "kara", "policy": "threshold"}, "base"),
    ({"method": "centroid", "policy": "threshold"}, "policy"),
])
def test_rules_between_method_and_common_fields(setting, param):
    from compression.config import ConfigError, coerce

    with pytest.raises(ConfigError) as err:
        coerce(setting)
    assert err.value.param == f"kv_compression.{param}"
    ok = dict(setting)
    ok.pop(param)
    if param != "policy":
        coerce(ok)  # the same setting without the offending field is fine


# ---------------------------------------------------------------------------------------------- thresholds
def test_snapkv_threshold_form_is_the_threshold_baseline(make_engine):
    # "threshold" stays the SnapKV threshold baseline; "snapkv" under the threshold policy selects the same slots
    eng = make_engine()
    prompts = [list(range(5, 15)), list(range(40, 52))]
    common = dict(THRESHOLD)
    common.pop("policy")
    a = eng.generate(prompts, greedy(60, kv_compression={"method": "threshold", **common}), use_tqdm=False)
    b = eng.generate(prompts, greedy(60, kv_compression={"method": "snapkv", "policy": "threshold", **common}),
                     use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    by = {name: r.as_dict() for name, r in eng.stats().compression.by_method.items()}
    assert by["threshold"]["rounds"] == by["snapkv"]["rounds"] >= 3
    assert by["threshold"]["tokens_evicted"] == by["snapkv"]["tokens_evicted"]
    # and the outputs differ from no compression at all (the comparison can fail)
    c = eng.generate(prompts, greedy(60), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in c] != [o.outputs[0].token_ids for o in a]


def test_rkv_with_its_own_schedule(make_engine, monkeypatch):
    """R-KV's schedule as a setting: compress to N once N + 128 slots are reached, observing the last 8 tokens."""
    from compression.rkv import RKVCompressor, rkv_threshold_select

    seen = []
    real = RKVCompressor.select_prefix
    monkeypatch.setattr(RKVCompressor, "select_prefix",
                        lambda self, q, k, b: seen.append((q, k, b, real(self, q, k, b))) or seen[-1][3])
    cfg = {"method": "rkv", "policy": "threshold", "threshold_target": 24, "threshold_max": 24 + 128,
           "observation_window": 8}
    eng = make_engine(kv_compression=cfg)
    req = eng.new_request(list(range(5, 15)), greedy(180), "r")
    eng.add_request(req)
    lengths = []
    run_until_done(eng, req, lambda: lengths.append(req.seqs[0].kv_len) if not req.seqs[0].is_finished else None)
    # between steps the cache holds at most 151 slots: the step that writes slot 152 compresses it to 24
    assert max(lengths) == 151 and [(a, b) for a, b in zip(lengths, lengths[1:]) if b < a] == [(151, 24)]
    q, k, budget, kept = seen[0]
    assert q.shape[2] == 8 and k.shape[2] == 152 and budget == 16
    assert torch.equal(kept, rkv_threshold_select(q, k, 16, lam=0.1, kernel=7, sim_threshold=0.5))

"""bench/pareto.py: the Pareto front and the best-under-a-bound rule on hand-made points (with a wrong front shown
to fail), the small accounting helpers, and a smoke run of the sweep's two measurements on the tiny model."""
from __future__ import annotations

import argparse
import math

import pytest

from bench.pareto_front import Point, best_within, cost_bound, dominates, pareto_front
from bench.pareto_runs import (Setting, first_divergence, max_windows, quality_runs, throughput_runs,
                               triggered_requests, window_settings)

# Hand-made points: (cost = NLL Δ, gain = throughput ratio). Worked by hand:
#   a (0.00, 1.00) front: the cheapest
#   b (0.01, 1.30) front
#   c (0.01, 1.20) dominated by b (same cost, lower gain)
#   d (0.02, 1.30) dominated by b (higher cost, same gain)
#   e (0.03, 1.60) front, and f is its exact tie (both stay)
#   f (0.03, 1.60) front
#   g (0.05, 1.50) dominated by e
#   h (0.06, 1.90) front: the fastest
#   i (-0.01, 0.90) front: negative cost (noise) and the lowest gain, nothing is cheaper
#   j (nan, 2.00) left out (no quality number)
PTS = [Point("a", 0.00, 1.00), Point("b", 0.01, 1.30), Point("c", 0.01, 1.20), Point("d", 0.02, 1.30),
       Point("e", 0.03, 1.60), Point("f", 0.03, 1.60), Point("g", 0.05, 1.50), Point("h", 0.06, 1.90),
       Point("i", -0.01, 0.90), Point("j", float("nan"), 2.00)]
FRONT = ["i", "a", "b", "e", "f", "h"]


def brute_front(points):
    """The definition, O(n²): the points nothing dominates."""
    ok = [p for p in points if not math.isnan(p.cost) and not math.isnan(p.gain)]
    return {p.name for p in ok if not any(dominates(q, p) for q in ok)}


def wrong_front_drops_ties(points):
    """A plausible bug: a point must be *strictly* better in gain than everything cheaper-or-equal seen so far."""
    out, best = [], float("-inf")
    for p in sorted((p for p in points if p.cost == p.cost), key=lambda p: (p.cost, -p.gain)):
        if p.gain > best:
            out.append(p)
            best = p.gain
    return out


def wrong_front_max_gain_per_cost(points):
    """Another: the best gain at each cost, without checking cheaper points (keeps dominated d and g)."""
    best: dict[float, Point] = {}
    for p in points:
        if p.cost == p.cost and (p.cost not in best or p.gain > best[p.cost].gain):
            best[p.cost] = p
    return sorted(best.values(), key=lambda p: p.cost)


def test_front_on_hand_made_points():
    front = pareto_front(PTS)
    assert [p.name for p in front] == FRONT
    assert {p.name for p in front} == brute_front(PTS)
    assert [p.cost for p in front] == sorted(p.cost for p in front)
    assert pareto_front(list(reversed(PTS))) == front  # order-independent
    assert pareto_front([]) == []
    assert [p.name for p in pareto_front([Point("x", 0.1, 1.0)])] == ["x"]


@pytest.mark.parametrize("wrong", [wrong_front_drops_ties, wrong_front_max_gain_per_cost])
def test_a_wrong_front_fails_the_same_checks(wrong):
    names = [p.name for p in wrong(PTS)]
    assert names != FRONT or set(names) != brute_front(PTS)


def test_front_matches_the_definition_on_random_points():
    import random

    rng = random.Random(0)
    for _ in range(200):
        pts = [Point(str(k), rng.choice([0.0, 0.01, 0.02, 0.03]), rng.choice([1.0, 1.1, 1.2, 1.3]))
               for k in range(rng.randrange(1, 12))]  # a coarse grid: many ties
        assert {p.name for p in pareto_front(pts)} == brute_front(pts)


def test_best_within_a_bound():
    bound = cost_bound(3.0)  # 1% of a full-cache NLL of 3.0
    assert bound == pytest.approx(0.03)
    assert best_within(PTS, bound).name == "e"  # e and f tie on both axes: the name breaks it
    assert best_within(PTS, 0.029).name == "b"  # d has b's gain at a higher cost
    assert best_within(PTS, 0.0).name == "a"
    assert best_within(PTS, -0.02) is None
    assert best_within(PTS, 1.0).name == "h"
    for b in (0.0, 0.01, 0.02, 0.03, 0.05, 0.1):  # the best is always on the front
        assert best_within(PTS, b) in pareto_front(PTS)
    # equal gain: the cheaper wins
    assert best_within([Point("x", 0.02, 1.3), Point("y", 0.01, 1.3)], 0.05).name == "y"
    with pytest.raises(ValueError):
        cost_bound(0.0)


def test_accounting_helpers():
    assert first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([5], [6]) == 0
    assert "|" not in Setting("kara_lossless", 512, 0.3).name  # names go into markdown cells
    f = window_settings(512)
    assert f == dict(window=512, buffer=64, chunk_max=8, chunk_budget=16, compression_period=448)
    assert max_windows(2048, f) == (2048 - 64) // 448 == 4
    assert triggered_requests(24, 6, 4) == 6  # every request filled its 4 windows
    assert triggered_requests(5, 6, 4) == 2  # at least 2 requests hold 5 windows
    assert triggered_requests(0, 6, 4) == 0


POINTS = [Setting("kara", 16, 0.3), Setting("streaming", 16, 0.5)]


def test_smoke_two_points_get_both_numbers(make_engine):
    """The sweep's two measurements on the tiny model for two settings: a throughput ratio on a pressured pool and
    NLL increases for each, then the front and the report built from them."""
    from bench.compression_quality import synthetic_trials
    from bench.pareto_report import report

    out_len, num = 40, 4
    per_seq = -(-(6 + out_len) // 4)
    eng = make_engine(num_kv_blocks=2 * per_seq, max_num_seqs=num, max_model_len=64, watermark=0.0,
                      preemption_mode="swap")
    prompts = [[4 + (7 * i + j) % 100 for j in range(6)] for i in range(num)]
    runs = throughput_runs(eng, prompts, POINTS, out_len, "2")
    assert [r["setting"] for r in runs] == [None, *POINTS, None]
    for r in runs[1:-1]:
        assert r["tok_s"] > 0 and math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert r["triggered"] == num  # every request compressed (40 tokens fill 2 windows of 14)
        assert 0 <= r["agree_mean"] <= out_len and r["mean_batch"] > 0
    assert runs[0]["preemptions"] > 0  # the pool really is short for none

    qeng = make_engine(num_kv_blocks=256)
    trials = synthetic_trials(2, vocab=qeng.model_config.vocab_size, filler_len=40, lead_len=4, passage_len=6,
                              context_len=5)
    quality = quality_runs(qeng, trials, POINTS, batch_seqs=8)
    assert quality["none"]["text"] > 0
    for s in POINTS:
        q = quality[s.key]
        assert all(math.isfinite(q[k]) for k in ("d_text", "d_recall", "d_late")) and not q["exact"]
        assert q["d_text"] == pytest.approx(q["text"] - quality["none"]["text"])
    assert any(quality[s.key]["d_text"] != 0 for s in POINTS)  # compression changed the NLL

    args = argparse.Namespace(model="tiny", dtype="float32", methods=["kara", "streaming"], windows=[16],
                              ratios=[0.3, 0.5], with_default=False, pools=["2"], oversubscription=2.0,
                              ample_requests=num, ample_for="front", output_per_window=2, trials=2, quality_tokens=56,
                              passage_len=6, threads=1, workers=1)
    # settings_for(args) yields kara/streaming at both ratios; only the two measured points enter the report
    body, _ = report(args, quality, runs, {("quality",): (1.0, 1.0)}, 2.0, write_plots=False)
    assert "Pareto front, pool for 2" in body and "Best setting at a text-NLL cost <= 1%" in body
    for s in POINTS:
        assert s.name in body
    assert_tables_well_formed(body)


def assert_tables_well_formed(body: str) -> None:
    """Every row of every markdown table has as many cells as its header (a stray "|" in a cell breaks this)."""
    width = None
    for line in body.splitlines():
        if not line.startswith("|"):
            width = None
            continue
        cells = line.count("|") - line.count("\\|")
        width = cells if width is None else width
        assert cells == width, line


def test_lossless_point_is_exact(make_engine):
    """Lossless Kara's quality Δ is taken as 0: its greedy outputs must equal none's on a pressured pool."""
    out_len, num = 40, 3
    eng = make_engine(num_kv_blocks=2 * -(-(6 + out_len) // 4), max_num_seqs=num, max_model_len=64, watermark=0.0,
                      preemption_mode="swap")
    prompts = [[4 + (5 * i + j) % 100 for j in range(6)] for i in range(num)]
    runs = throughput_runs(eng, prompts, [Setting("kara_lossless", 16, 0.2)], out_len, "2", bracket=False, repeats=2)
    r = runs[1]
    assert len(runs) == 2 and len(r["tok_s_runs"]) == 2 and r["tok_s"] == min(r["tok_s_runs"])  # lower median
    assert r["agree_identical"] == 1.0 and r["agree_mean"] == out_len
    assert r["windows_per_request"] > 0 and r["verify_share"] > 0


def _fake(settings_ratios: dict, quality_d: dict) -> tuple[dict, list[dict]]:
    """quality and run records from {setting: {pool: ratio}} and {setting: (d_text, d_recall)}."""
    quality = {"none": {"text": 3.0, "recall": 1.0}}
    runs = []
    extra = {"mean_batch": 4.0, "num_requests": 4, "comp_share": 0.01, "verify_share": 0.0, "preemptions": 0}
    for s, by in settings_ratios.items():
        quality[s.key] = {"d_text": quality_d[s][0], "d_recall": quality_d[s][1]}
        runs += [{"pool": p, "setting": s, "ratio": r, "output_len": 4 * s.window, **extra} for p, r in by.items()]
    runs += [{"pool": p, "setting": None, "ratio": 1.0, "output_len": 512, **extra} for p in ("2", "4", "ample")]
    return quality, runs


def test_recommendation_and_ample_candidates_by_hand():
    from bench.pareto_report import ample_candidates, by_pool, recommend

    k2, k5, kd = Setting("kara", 128, 0.2), Setting("kara", 128, 0.5), Setting("keydiff", 128, 0.2)
    st, sn = Setting("streaming", 128, 0.2), Setting("snapkv", 128, 0.5)
    ratios = {k2: {"2": 1.6, "4": 1.4}, k5: {"2": 1.3, "4": 1.2}, kd: {"2": 1.7, "4": 1.5},
              st: {"2": 1.8, "4": 1.6}, sn: {"2": 1.2, "4": 1.1}}
    # bound = 1% of 3.0 = 0.03: streaming (0.05) is out; snapkv is dominated by kara r=0.5 on both pools and axes
    d = {k2: (0.02, 0.5), k5: (0.01, 0.2), kd: (0.025, 0.4), st: (0.05, 0.9), sn: (0.012, 0.3)}
    quality, runs = _fake(ratios, d)
    settings = [k2, k5, kd, st, sn]
    (v, best), (kv, kbest) = recommend(settings, quality, by_pool(runs), 0.03, ["2", "4", "ample"])
    assert best == kd and v == pytest.approx(math.sqrt(1.7 * 1.5))
    assert kbest == k2 and kv == pytest.approx(math.sqrt(1.6 * 1.4))
    # an ample-pool regression disqualifies: keydiff at 0.97x on the ample pool gives way to Kara r=0.2
    runs.append({"pool": "ample", "setting": kd, "ratio": 0.97, "output_len": 512})  # (only ratio is read)
    assert recommend(settings, quality, by_pool(runs), 0.03, ["2", "4", "ample"])[0][1] == k2
    runs.pop()
    # the targets table names the best per pool and compares the best Kara setting with today's default
    from bench.pareto_report import records_from_json, records_json, targets_table

    dflt = Setting("kara_default", 512, 0.3)
    q2, runs2 = _fake({**ratios, dflt: {"2": 1.5, "4": 1.3}}, {**d, dflt: (0.01, 0.1)})
    text = targets_table(settings + [dflt], q2, by_pool(runs2), ["2", "4"], 0.03)
    assert "| pool for 2 | 1.4x | KeyDiff W=128 r=0.2 | 1.70x |" in text
    assert f"The best Kara setting, {k2.name} (1.50)" in text and "default (1.40)" in text
    assert_tables_well_formed(text)
    q3, runs3, _ = records_from_json(records_json(q2, runs2, {("quality",): (1.0, 2.0)}))
    assert q3 == q2 and runs3 == runs2

    cand = ample_candidates(settings, quality, runs, ["2", "4"])
    # text fronts: k5, k2, kd, st (sn is dominated by k5); recall fronts: k5, kd, st (k2 by kd)
    assert set(cand) == {k5, kd, st, k2}
    assert sn not in cand


def test_requests_per_pool_and_units():
    from bench.pareto import num_requests, units

    args = argparse.Namespace(oversubscription=2.0, ample_requests=2, methods=["kara", "rkv"], windows=[128, 512],
                              ratios=[0.2, 0.5], with_default=True, pools=["2", "4", "ample"], ample_for="front")
    assert (num_requests(args, "2"), num_requests(args, "4"), num_requests(args, "ample")) == (4, 8, 2)
    todo = units(args)
    assert todo[0][0] == "quality" and len(todo[0][1]) == 2 * 2 * 2 + 1  # + the engine default
    assert [(u[1], u[2]) for u in todo[1:]] == [(512, "2"), (512, "4"), (128, "2"), (128, "4")]
    assert sum(s.method == "kara_default" for s in todo[1][3]) == 1  # the default runs with the |W| = 512 group
    args.ample_for = "all"
    assert [(u[1], u[2]) for u in units(args)[1:]][-1] == (128, "ample")


def test_quality_over_two_window_groups(make_engine):
    """Settings with different window fields are scored in separate groups against one full-cache run; lossless
    Kara takes the full cache's numbers; each Δ after the first round compares the same tokens."""
    from bench.compression_quality import synthetic_trials

    eng = make_engine(num_kv_blocks=256)
    trials = synthetic_trials(2, vocab=eng.model_config.vocab_size, filler_len=50, lead_len=4, passage_len=6,
                              context_len=5)
    pts = [Setting("kara", 16, 0.3), Setting("keydiff", 24, 0.3), Setting("kara_lossless", 16, 0.3)]
    q = quality_runs(eng, trials, pts, batch_seqs=8)
    assert set(q) == {"none", *(s.key for s in pts)}
    a, b, lossless = (q[s.key] for s in pts)
    assert lossless["exact"] and lossless["d_text"] == lossless["d_recall"] == lossless["d_late"] == 0
    for x in (a, b):
        assert not x["exact"] and x["d_text"] == pytest.approx(x["text"] - q["none"]["text"])
    # the full cache's NLL after the first round is taken over each setting's own tokens (|W| = 16 and 24 start
    # compressing at different tokens), so the two references differ
    assert a["late"] - a["d_late"] != pytest.approx(b["late"] - b["d_late"])


def test_sweep_end_to_end_on_the_tiny_model(tiny_llama_dir):
    """The CLI's own path, in process (one worker): quality and pressured-pool units, then the ample pool for the
    settings `ample_candidates` picks, then the report."""
    from bench.pareto import sweep
    from bench.pareto_report import report

    args = argparse.Namespace(model=str(tiny_llama_dir), dtype="float32", methods=["kara", "streaming"], windows=[16],
                              ratios=[0.3], with_default=False, pools=["2", "ample"], oversubscription=2.0,
                              ample_requests=2, ample_for="front", output_per_window=2, trials=1, quality_tokens=60,
                              passage_len=6, batch_seqs=8, threads=1, workers=1, no_bracket=False, repeats=1,
                              clock="wall")
    quality, runs, seconds = sweep(args)
    assert set(seconds) == {("quality",), ("throughput", 16, "2"), ("throughput", 16, "ample")}
    measured = {(r["pool"], r["setting"].method) for r in runs if r["setting"] is not None}
    assert {("2", "kara"), ("2", "streaming")} <= measured and any(p == "ample" for p, _ in measured)
    assert all(r["num_requests"] == {"2": 4, "ample": 2}[r["pool"]] for r in runs)
    body, _ = report(args, quality, runs, seconds, 1.0, write_plots=False)
    assert "Pareto front, ample pool" in body
    assert_tables_well_formed(body)

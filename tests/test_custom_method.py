"""A new score-based KV-compression method is one small class (compression/base.py `ScoreMethod`): it is defined
here, registered at run time, selected per request over HTTP, and the slots it keeps are checked in the engine's KV
cache against a hand-worked case."""
from __future__ import annotations

import httpx
import pytest
import torch

from compression import registry
from compression.base import ScoreMethod, Span
from server_fixtures import *  # noqa: F401,F403


class KeepOldest(ScoreMethod):
    """score = -position: the oldest ⌈r·n⌉ slots of each window's region survive (query-free)."""

    needs_queries = False
    policies = ("periodic",)

    def score(self, span: Span) -> torch.Tensor:
        n = span.num_scored
        return -torch.arange(n, dtype=torch.float32, device=span.keys.device).expand(*span.keys.shape[:2], n)


@pytest.fixture
def keep_oldest():
    registry.register("test_keep_oldest", KeepOldest, description="test only: keep the oldest region slots")
    yield "test_keep_oldest"
    registry.unregister("test_keep_oldest")


def test_a_score_method_defined_here_is_served_per_request(tiny_engine, tiny_server, drained, keep_oldest,
                                                          monkeypatch):
    kv = tiny_engine.core.kv
    real_compact, seen = kv.compact, []

    def compact(jobs):  # each job's region keys before and the cache after: what survived where
        before = [kv.gather_keys(j.seq, j.region_start, j.kv_len - j.region_start) for j in jobs]
        freed = real_compact(jobs)
        seen.extend((j, b, kv.gather_keys(j.seq, j.region_start, j.seq.kv_len - j.region_start))
                    for j, b in zip(jobs, before))
        return freed

    monkeypatch.setattr(kv, "compact", compact)
    # |W| = 16, |U| = 4: regions of n = 12 slots, of which ⌈0.25 · 12⌉ = 3 are kept
    setting = {"method": keep_oldest, "window": 16, "buffer": 4, "ratio": 0.25, "compression_period": 12}
    body = {"model": tiny_engine.model_name, "prompt": "The quick brown fox jumps over the lazy dog because",
            "max_tokens": 40, "temperature": 0, "ignore_eos": True, "kv_compression": setting}
    r = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    prompt_len = r.json()["usage"]["prompt_tokens"]
    # Hand-worked: the prompt is not compressed; the first round (16 tokens generated) takes the window of logical
    # positions [P, P + 16), keeps its region's oldest three, P, P + 1 and P + 2, in KV slots P..P+2, and moves the
    # buffer (positions P + 12..P + 15) right after them; every later round does the same 12 slots further on.
    assert len(seen) >= 2
    assert seen[0][0].region_start == prompt_len and seen[1][0].region_start == prompt_len + 3
    for job, before, after in seen:
        assert job.region_len == 12 and job.kept.tolist() == [[[0, 1, 2]] * 2] * 2  # [L=2, Hkv=2, K=3]
        assert torch.equal(after, torch.cat([before[:, :, :3], before[:, :, 12:]], dim=2))
    by = tiny_engine.stats().compression.by_method[keep_oldest]
    assert by.tokens_seen == 12 * len(seen) and by.tokens_evicted == 9 * len(seen)

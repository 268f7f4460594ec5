"""Independent cross-check against NVIDIA kvpress 0.5.5 (installed with ``pip install --no-deps kvpress==0.5.5``, see
the Makefile): the same keys / queries go to kvpress's presses and to ours, and the kept index SETS must agree
(kvpress's ScorerPress keeps ``scores.topk(n_kept)``, unsorted; ours are sorted).

How kvpress is driven: ``press.compress(module, hidden_states, keys, values, attentions, kwargs)`` with a minimal
fake attention module (config.num_attention_heads / num_key_value_heads, head_dim), dummy hidden states, the
attention probabilities computed here when the press needs them (TOVA, SnapKV: given ``attentions`` they do not
recompute queries), and values whose first channel holds the slot index, so the values it returns name the kept
slots. kvpress's batch axis carries our layer-like axis L.

Convention differences (all handled below, none hides a disagreement):
  * kvpress scores the whole sequence and keeps n_kept = int(T * (1 - compression_ratio)) including the
    protected slots; ours score a region and the caller keeps the buffer / observation window. So: keydiff and
    knorm use region = the whole sequence; TOVA's protected last token and SnapKV's observation window are our
    buffer (region = the slots before it, k = n_kept - |buffer|).
  * StreamingLLM: kvpress keeps n_sink first tokens plus the newest; ours (`RecentCompressor`) keeps the newest
    region slots, the sinks being the prompt's first tokens outside any region. With n_sink = 0 they are the same
    method; with n_sink = 4 we compare against sinks + RecentCompressor on the slots after them.
  * SnapKV: kvpress averages over the window queries, ours sums (same ranking); both average over the GQA group.
    TOVA averages over all query heads in both.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
import sys
import types

import pytest
import torch

import compression.baselines as bl
from compression import KVCompressionConfig, RecentCompressor, snapkv_scores, snapkv_select

REASON = "kvpress 0.5.5 is not installed (make install runs: pip install --no-deps kvpress==0.5.5)"
PRESSES = ("keydiff_press", "knorm_press", "tova_press", "streaming_llm_press", "snapkv_press")


@pytest.fixture(scope="module")
def kvp():
    """The press modules. ``import kvpress`` runs its __init__, which imports every press, and some of those need
    packages that a --no-deps install leaves out (cachetools, datasets, ...). The presses used here need only
    torch and transformers, so when the full import fails they are loaded from the installed files under a bare
    package object (no __init__: its attention patching is not needed either)."""
    if importlib.util.find_spec("kvpress") is None:
        pytest.skip(REASON)
    version = importlib.metadata.version("kvpress")
    if version != "0.5.5":
        pytest.skip(f"kvpress {version} is installed; this cross-check is written against 0.5.5")
    saved = {k: v for k, v in sys.modules.items() if k == "kvpress" or k.startswith("kvpress.")}
    try:
        import kvpress  # noqa: F401
    except ImportError:
        spec = importlib.util.find_spec("kvpress")
        pkg = types.ModuleType("kvpress")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["kvpress"] = pkg
    mods = types.SimpleNamespace(**{name: pytest.importorskip(f"kvpress.presses.{name}", reason=REASON)
                                    for name in PRESSES})
    yield mods
    for k in [k for k in sys.modules if k == "kvpress" or k.startswith("kvpress.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def fake_module(hq, hkv, d):
    return types.SimpleNamespace(config=types.SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv),
                                 head_dim=d, layer_idx=0)


def causal_attentions(q, k):
    """Softmax(q k^T / sqrt(d)) with a causal mask, per query head (GQA: k repeated): [B, Hq, T, T] float32."""
    B, hq, T, d = q.shape
    kk = k.repeat_interleave(hq // k.shape[1], dim=1)
    logits = (q.double() @ kk.double().transpose(-1, -2)) / math.sqrt(d)
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1).float()


def kvpress_kept(press, keys, hq, attentions=None):
    """Kept slot sets per (batch row, KV head), from a full ScorerPress.compress call."""
    B, hkv, T, d = keys.shape
    values = torch.arange(T, dtype=torch.float64)[None, None, :, None].expand(B, hkv, T, d).clone()
    _, v = press.compress(fake_module(hq, hkv, d), torch.zeros(B, T, 1), keys, values, attentions, {})
    return [[set(v[b, h, :, 0].long().tolist()) for h in range(hkv)] for b in range(B)]


def as_sets(kept, extra=()):
    return [[set(row.tolist()) | set(extra) for row in layer] for layer in kept]


def n_kept(T, ratio):
    return int(T * (1 - ratio))


CASES = [(0, 1, 24, 0.5), (1, 2, 31, 0.3), (2, 3, 40, 0.75), (3, 2, 17, 0.1)]  # (seed, g, T, compression_ratio)


def make(seed, g, T, L=2, hkv=2, d=16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(L, hkv * g, T, d, generator=gen), torch.randn(L, hkv, T, d, generator=gen) * 2


@pytest.mark.parametrize("seed,g,T,ratio", CASES)
def test_keydiff(kvp, seed, g, T, ratio):
    q, k = make(seed, g, T)
    got = bl.keydiff_select(None, k, T, n_kept(T, ratio))
    assert as_sets(got) == kvpress_kept(kvp.keydiff_press.KeyDiffPress(compression_ratio=ratio), k, q.shape[1])


@pytest.mark.parametrize("seed,g,T,ratio", CASES)
def test_knorm(kvp, seed, g, T, ratio):
    q, k = make(seed, g, T)
    got = bl.knorm_select(None, k, T, n_kept(T, ratio))
    assert as_sets(got) == kvpress_kept(kvp.knorm_press.KnormPress(compression_ratio=ratio), k, q.shape[1])


@pytest.mark.parametrize("seed,g,T,ratio", CASES)
def test_tova(kvp, seed, g, T, ratio):
    q, k = make(seed, g, T)
    exp = kvpress_kept(kvp.tova_press.TOVAPress(compression_ratio=ratio), k, q.shape[1], causal_attentions(q, k))
    keep = n_kept(T, ratio) - 1  # kvpress protects the newest token; it is our buffer
    assert as_sets(bl.tova_select(q, k, T - 1, keep), extra=[T - 1]) == exp
    assert as_sets(bl.tova_threshold_select(q[:, :, -1:], k, keep), extra=[T - 1]) == exp


@pytest.mark.parametrize("seed,g,T,ratio", CASES)
@pytest.mark.parametrize("window", [4, 8])
def test_snapkv(kvp, seed, g, T, ratio, window):
    q, k = make(seed, g, T)
    press = kvp.snapkv_press.SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=5)
    exp = kvpress_kept(press, k, q.shape[1], causal_attentions(q, k))
    keep = n_kept(T, ratio) - window
    win = range(T - window, T)
    # Ours as a window method: the observation window is the buffer.
    assert as_sets(bl.snapkv_window_select(q, k, T - window, keep, kernel=5), extra=win) == exp
    # And the existing threshold baseline (compression/snapkv.py) on the same inputs.
    assert as_sets(snapkv_select(snapkv_scores(q[:, :, -window:], k, 5), keep), extra=win) == exp


@pytest.mark.parametrize("T,ratio", [(20, 0.25), (33, 0.5), (16, 0.1)])
def test_streaming(kvp, T, ratio):
    q, k = make(0, 2, T)
    nk = n_kept(T, ratio)
    exp0 = kvpress_kept(kvp.streaming_llm_press.StreamingLLMPress(compression_ratio=ratio, n_sink=0), k, q.shape[1])
    ours = RecentCompressor(KVCompressionConfig(method="streaming", ratio=nk / T, chunk_budget=0))
    assert as_sets(ours.select(q, k, T)) == exp0
    # n_sink = 4: the sinks sit outside our region; the region is what follows them.
    exp4 = kvpress_kept(kvp.streaming_llm_press.StreamingLLMPress(compression_ratio=ratio, n_sink=4), k, q.shape[1])
    ours4 = RecentCompressor(KVCompressionConfig(method="streaming", ratio=(nk - 4) / (T - 4), chunk_budget=0))
    kept = ours4.select(q[:, :, 4:], k[:, :, 4:], T - 4) + 4
    assert as_sets(kept, extra=range(4)) == exp4


def test_a_wrong_convention_is_caught(kvp):
    # Per-group attention averaging in TOVA (instead of all heads) disagrees with kvpress on these inputs.
    q, k = make(2, 3, 40)
    exp = kvpress_kept(kvp.tova_press.TOVAPress(compression_ratio=0.75), k, q.shape[1], causal_attentions(q, k))
    probs = causal_attentions(q, k)[:, :, -1, :-1]  # [L, Hq, T - 1]
    per_group = probs.reshape(2, 2, 3, 39).mean(2)
    assert as_sets(bl.select_topk(per_group, 9), extra=[39]) != exp

"""Tensor-parallel layers on 2 gloo processes vs the unsharded math (plain F.linear / F.embedding on the full
weights), fp32, max abs diff <= 1e-5. All cases run in ONE spawned 2-rank job (module fixture): process spawn and
torch import cost seconds each on a 2-core machine. Two deliberately wrong shardings must fail the same check.

The tp=1 tests run in this process: the layers are then exactly the torch modules they replace and no
torch.distributed function is ever called.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.distributed import (NO_TP, ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                QKVParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding,
                                head_partition)
from engine.distributed.launch import RankFailed, run_ranks

TOL = 1e-5
TP = 2
T = 7  # tokens
HIDDEN, D = 24, 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def qkv_case(hq: int, hkv: int, seed: int) -> dict:
    g = _gen(seed)
    return {"x": torch.randn(T, HIDDEN, generator=g),
            "q": torch.randn(hq * D, HIDDEN, generator=g), "k": torch.randn(hkv * D, HIDDEN, generator=g),
            "v": torch.randn(hkv * D, HIDDEN, generator=g), "bq": torch.randn(hq * D, generator=g),
            "bk": torch.randn(hkv * D, generator=g), "bv": torch.randn(hkv * D, generator=g)}


def mlp_case(seed: int, inter: int = 12) -> dict:
    g = _gen(seed)
    return {"x": torch.randn(T, HIDDEN, generator=g), "gate": torch.randn(inter, HIDDEN, generator=g),
            "up": torch.randn(inter, HIDDEN, generator=g), "bg": torch.randn(inter, generator=g),
            "bu": torch.randn(inter, generator=g)}


def row_case(seed: int, d_in: int = 16, d_out: int = 6) -> dict:
    g = _gen(seed)
    return {"x": torch.randn(T, d_in, generator=g), "w": torch.randn(d_out, d_in, generator=g),
            "b": torch.randn(d_out, generator=g)}


VOCAB = 11  # odd: 6 rows per rank, the last rank holds 5 real rows and one padding row
IDS = torch.tensor([0, 5, 6, 10, 3, 7, 6, 5])  # both shards and both shard edges


def vocab_case(seed: int) -> dict:
    g = _gen(seed)
    return {"w": torch.randn(VOCAB, HIDDEN, generator=g), "h": torch.randn(T, HIDDEN, generator=g)}


# ---- the 2-rank job --------------------------------------------------------------------------------------------
def _qkv(tp, c, hq, hkv, bias=True):
    layer = QKVParallelLinear(HIDDEN, D, hq, hkv, bias, tp)
    for piece, (w, b) in enumerate([("q", "bq"), ("k", "bk"), ("v", "bv")]):
        layer.load_hf_weight("weight", c[w], piece, f"{w}_proj.weight")
        if bias:
            layer.load_hf_weight("bias", c[b], piece, f"{w}_proj.bias")
    return layer


def _row(tp, c, bias):
    layer = RowParallelLinear(c["w"].shape[1], c["w"].shape[0], bias, tp)
    layer.load_hf_weight("weight", c["w"], None, "w")
    if bias:
        layer.load_hf_weight("bias", c["b"], None, "b")
    local = c["x"].shape[1] // tp.size  # the rank's input is its slice of a column-parallel output
    return layer, c["x"][:, tp.rank * local:(tp.rank + 1) * local]


def layer_job(tp: TPGroup) -> dict:
    import engine.distributed.layers as layers_mod
    from engine.distributed.comm import broadcast_object
    from engine.distributed.kv import common_num_blocks

    out = {}
    with torch.no_grad():
        c = qkv_case(4, 2, seed=1)
        out["qkv_bias"] = _qkv(tp, c, 4, 2)(c["x"])
        c = qkv_case(4, 1, seed=2)
        out["qkv_replicated_kv"] = _qkv(tp, c, 4, 1)(c["x"])
        c = qkv_case(6, 2, seed=3)
        out["qkv_no_bias"] = _qkv(tp, c, 6, 2, bias=False)(c["x"])

        c = mlp_case(seed=4)
        gu = MergedColumnParallelLinear(HIDDEN, [12, 12], True, tp)
        for piece, (w, b) in enumerate([("gate", "bg"), ("up", "bu")]):
            gu.load_hf_weight("weight", c[w], piece, w)
            gu.load_hf_weight("bias", c[b], piece, b)
        out["gate_up"] = gu(c["x"])
        col = ColumnParallelLinear(HIDDEN, [12], False, tp)
        col.load_hf_weight("weight", c["gate"], None, "gate")
        out["column"] = col(c["x"])

        c = row_case(seed=5)
        layer, x = _row(tp, c, bias=True)
        out["row_bias"] = layer(x)
        layer, x = _row(tp, c, bias=False)
        out["row_no_bias"] = layer(x)

        c = vocab_case(seed=6)
        emb = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
        emb.load_hf_weight("weight", c["w"], None, "embed_tokens.weight")
        out["embedding"] = emb(IDS)
        head = ParallelLMHead(HIDDEN, VOCAB, tp)
        head.load_hf_weight("weight", c["w"], None, "lm_head.weight")
        out["lm_head_to_rank0"] = head(c["h"])
        out["lm_head_all_ranks"] = head(c["h"], all_ranks=True)

        # wrong on purpose: the row-parallel layer without its all-reduce ...
        c = row_case(seed=5)
        layer, x = _row(tp, c, bias=True)
        saved = layers_mod.all_reduce
        layers_mod.all_reduce = lambda y, tp: y
        try:
            out["broken_row_no_all_reduce"] = layer(x)
        finally:
            layers_mod.all_reduce = saved
        # ... and the fused q/k/v weight split evenly by rows instead of per piece (q/k/v) and head
        c = qkv_case(4, 2, seed=1)
        naive = ColumnParallelLinear(HIDDEN, [(4 + 2 * 2) * D], True, tp)
        naive.load_hf_weight("weight", torch.cat([c["q"], c["k"], c["v"]]), None, "qkv")
        naive.load_hf_weight("bias", torch.cat([c["bq"], c["bk"], c["bv"]]), None, "qkv")
        out["broken_qkv_even_rows"] = naive(c["x"])

    out["num_blocks"] = common_num_blocks(100 - 13 * tp.rank, tp)
    out["plan"] = broadcast_object({"tables": [[3, 1], [2]], "rank": tp.rank}, tp)
    return out


@pytest.fixture(scope="module")
def ranks():
    import time

    t0 = time.perf_counter()
    results = run_ranks(layer_job, TP, timeout_s=120)
    print(f"\n2-rank layer job: {time.perf_counter() - t0:.1f} s (spawn + import + all cases)")
    return results


# ---- references (unsharded math) -------------------------------------------------------------------------------
def _rows(t, start, n):
    return t[start:start + n]


def ref_qkv(c, hq, hkv, rank, bias=True):
    """This rank's expected output: its query heads' q, then its KV heads' k and v (one replicated KV head
    per rank when tp > hkv)."""
    q = F.linear(c["x"], c["q"], c["bq"] if bias else None)
    k = F.linear(c["x"], c["k"], c["bk"] if bias else None)
    v = F.linear(c["x"], c["v"], c["bv"] if bias else None)
    nq = hq // TP
    if hkv % TP == 0:
        nkv, kv0 = hkv // TP, rank * (hkv // TP)
    else:
        nkv, kv0 = 1, rank // (TP // hkv)
    return torch.cat([q[:, rank * nq * D:(rank + 1) * nq * D], k[:, kv0 * D:(kv0 + nkv) * D],
                      v[:, kv0 * D:(kv0 + nkv) * D]], dim=1)


def ref_case(name: str, rank: int):
    if name == "qkv_bias":
        return ref_qkv(qkv_case(4, 2, 1), 4, 2, rank)
    if name == "qkv_replicated_kv":
        return ref_qkv(qkv_case(4, 1, 2), 4, 1, rank)
    if name == "qkv_no_bias":
        return ref_qkv(qkv_case(6, 2, 3), 6, 2, rank, bias=False)
    if name in ("gate_up", "column"):
        c = mlp_case(4)
        gate = F.linear(c["x"], c["gate"], c["bg"] if name == "gate_up" else None)
        half = gate.shape[1] // TP
        if name == "column":
            return gate[:, rank * half:(rank + 1) * half]
        up = F.linear(c["x"], c["up"], c["bu"])
        return torch.cat([gate[:, rank * half:(rank + 1) * half], up[:, rank * half:(rank + 1) * half]], dim=1)
    if name in ("row_bias", "row_no_bias", "broken_row_no_all_reduce"):
        c = row_case(5)
        return F.linear(c["x"], c["w"], None if name == "row_no_bias" else c["b"])
    if name == "embedding":
        return F.embedding(IDS, vocab_case(6)["w"])
    if name in ("lm_head_to_rank0", "lm_head_all_ranks"):
        c = vocab_case(6)
        return None if name == "lm_head_to_rank0" and rank > 0 else F.linear(c["h"], c["w"])
    if name == "broken_qkv_even_rows":
        return ref_qkv(qkv_case(4, 2, 1), 4, 2, rank)
    raise KeyError(name)


def max_diff(out, ref) -> float:
    if out is None or ref is None:
        assert out is None and ref is None, "only rank 0 receives gathered logits"
        return 0.0
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    return (out - ref).abs().max().item()


CASES = ["qkv_bias", "qkv_replicated_kv", "qkv_no_bias", "gate_up", "column", "row_bias", "row_no_bias",
         "embedding", "lm_head_to_rank0", "lm_head_all_ranks"]


@pytest.mark.parametrize("name", CASES)
def test_parallel_layer_matches_unsharded(ranks, name):
    diffs = [max_diff(ranks[r][name], ref_case(name, r)) for r in range(TP)]
    print(f"{name}: max |diff| per rank {['%.1e' % d for d in diffs]}")
    assert max(diffs) <= TOL


@pytest.mark.parametrize("name", ["broken_row_no_all_reduce", "broken_qkv_even_rows"])
def test_wrong_sharding_fails_the_comparison(ranks, name):
    diffs = [max_diff(ranks[r][name], ref_case(name, r)) for r in range(TP)]
    print(f"{name}: max |diff| per rank {['%.1e' % d for d in diffs]}")
    assert max(diffs) > 100 * TOL


def test_block_count_is_the_minimum_and_plan_comes_from_rank0(ranks):
    assert [r["num_blocks"] for r in ranks] == [100 - 13 * (TP - 1)] * TP
    assert all(r["plan"] == {"tables": [[3, 1], [2]], "rank": 0} for r in ranks)


def _fails(tp: TPGroup) -> None:
    if tp.rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    import torch.distributed as dist

    dist.barrier(group=tp.cpu_group)  # rank 0 would wait here until the group timeout


def test_failing_rank_is_reported_and_the_others_stopped():
    import time

    t0 = time.perf_counter()
    with pytest.raises(RankFailed, match="rank 1 broke on purpose"):
        run_ranks(_fails, TP, timeout_s=60, group_timeout_s=60)
    assert time.perf_counter() - t0 < 30  # not the 60 s group timeout: rank 0 was killed, not waited for


def _hangs(tp: TPGroup) -> None:
    import time

    time.sleep(3600)


def test_timeout_kills_every_rank():
    import multiprocessing
    import time

    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        run_ranks(_hangs, TP, timeout_s=3)
    assert time.perf_counter() - t0 < 15
    assert multiprocessing.active_children() == []


# ---- tp = 1: the unsharded modules, no collective ------------------------------------------------------------
@pytest.fixture
def no_collectives(monkeypatch):
    import torch.distributed as dist

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective was called with tp=1")

    for fn in ("all_reduce", "all_gather", "gather", "broadcast", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(dist, fn, forbidden)


def test_tp1_layers_are_the_plain_modules_bit_for_bit(no_collectives):
    torch.manual_seed(0)
    x = torch.randn(T, HIDDEN)
    c = qkv_case(4, 2, seed=1)
    qkv = _qkv(NO_TP, c, 4, 2)
    fused = torch.nn.Linear(HIDDEN, 8 * D)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([c["q"], c["k"], c["v"]]))
        fused.bias.copy_(torch.cat([c["bq"], c["bk"], c["bv"]]))
    assert isinstance(qkv, torch.nn.Linear) and torch.equal(qkv(x), fused(x))
    c = row_case(seed=5)
    row, xr = _row(NO_TP, c, bias=True)
    plain = torch.nn.Linear(16, 6)
    with torch.no_grad():
        plain.weight.copy_(c["w"])
        plain.bias.copy_(c["b"])
    assert torch.equal(row(xr), plain(xr))
    c = vocab_case(6)
    emb = VocabParallelEmbedding(VOCAB, HIDDEN)
    emb.load_hf_weight("weight", c["w"], None, "w")
    assert emb.weight.shape == (VOCAB, HIDDEN) and torch.equal(emb(IDS), F.embedding(IDS, c["w"]))
    head = ParallelLMHead(HIDDEN, VOCAB)
    head.load_hf_weight("weight", c["w"], None, "w")
    assert torch.equal(head(c["h"]), F.linear(c["h"], c["w"]).float())


def test_tp1_model_step_calls_no_collective(no_collectives):
    from engine.models import DecoderLM, ModelConfig
    from helpers_models import Runner, tiny_hf_config

    torch.manual_seed(0)
    config = ModelConfig.from_hf(tiny_hf_config("qwen3"))
    model = DecoderLM(config).eval()
    run = Runner(model, config)
    out = run.step({0: [5, 6, 7], 1: [9]}, {0: [0, 1, 2], 1: [0]})
    assert out[0].shape == (3, config.vocab_size) and torch.isfinite(out[0]).all()
    q = run.queries({0: [7]}, {0: [2]})
    assert q.shape == (config.num_layers, 1, config.num_q_heads, config.head_dim)


# ---- configuration errors --------------------------------------------------------------------------------------
def test_head_partition_and_errors():
    assert head_partition(4, 2, 2) == (2, 1)
    assert head_partition(9, 3, 3) == (3, 1)
    assert head_partition(8, 2, 4) == (2, 1)  # KV heads replicated on 2 ranks each
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide num_q_heads \(9\)"):
        head_partition(9, 3, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide num_kv_heads \(3\)"):
        head_partition(6, 3, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide num_kv_heads \(6\)"):
        head_partition(12, 6, 4)


def test_model_construction_names_the_setting():
    from engine.models import DecoderLM, ModelConfig
    from helpers_models import tiny_hf_config

    config = ModelConfig.from_hf(tiny_hf_config("llama"))  # 4 q / 2 kv heads, intermediate 96
    with torch.device("meta"):
        with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_q_heads \(4\)"):
            DecoderLM(config, TPGroup(rank=0, size=3))
        config.intermediate_size = 95
        with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide intermediate_size \(95\)"):
            DecoderLM(config, TPGroup(rank=1, size=2))
    with pytest.raises(ValueError, match="rank"):
        TPGroup(rank=2, size=2)


def test_kv_cache_sizing_uses_the_local_kv_heads():
    from engine.distributed.kv import local_kv_heads, rank_num_blocks
    from engine.models import ModelConfig
    from helpers_models import tiny_hf_config
    from paging.kv_cache import bytes_per_block

    config = ModelConfig.from_hf(tiny_hf_config("llama", num_attention_heads=8, num_key_value_heads=4))
    mem = 10 * bytes_per_block(config.num_layers, 4, config.num_kv_heads, config.head_dim, torch.float32)
    assert [local_kv_heads(config, TPGroup(0, n)) for n in (1, 2, 4, 8)] == [4, 2, 1, 1]
    # the same memory holds tp times more blocks of 1/tp of the heads, until KV heads are replicated
    assert [rank_num_blocks(mem, config, 4, torch.float32, TPGroup(0, n)) for n in (1, 2, 4, 8)] == [10, 20, 40, 40]

"""GGUF blocks kept in the GEMM (engine/models/gguf_linear.py, csrc/kvllm_cpu.cpp block_linear): block decoding
against gguf-py's own dequantization, the kernel bit for bit against packed_linear on the dequantized weights and
within float32 rounding of a float64 reference, and SmolLM2 served with gemm_backend='gguf' against 'cpu'."""
import numpy as np
import pytest
import torch
from torch import nn

from engine.attention import cpu_ext

if not cpu_ext.is_available():
    if cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here", allow_module_level=True)
    cpu_ext.load()  # a compiler exists, so the build must work: raise its error instead of skipping
if not cpu_ext.load().has_avx2():
    pytest.skip("block_linear is AVX2 only", allow_module_level=True)

import gguf  # noqa: E402

from engine.models.gguf_linear import (BLOCK, BlockIndex, BlockLinear, block_linears, decode_blocks,  # noqa: E402
                                       dequantize, pack_blocks)
from engine.models.packed import PackedLinear, pack_weight  # noqa: E402

OPS = cpu_ext.load()
ISA = OPS.isa_level()
LEVELS = [pytest.param(1, id="avx2"),
          pytest.param(2, id="avx512", marks=pytest.mark.skipif(ISA < 2, reason="no AVX-512F on this CPU"))]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_decode_blocks_equals_gguf_dequantize(qtype):
    """Our (q, d, m) of a tensor gguf-py quantized dequantize to exactly gguf-py's own float32 values."""
    data = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(data, kind)
    q, d, m = decode_blocks(raw, qtype)
    assert q.shape == (24, 96) and d.shape == m.shape == (24, 96 // BLOCK)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))
    assert torch.equal(dequantize(q, d, m).view(torch.int32), ref.view(torch.int32))
    assert decode_blocks(raw, "Q6_K") is None


def _blocks(n: int, k: int, groups: int, signed: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randint(-128, 128, (n, k), generator=g) if signed else torch.randint(0, 16, (n, k), generator=g))
    d = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(n, groups, generator=g) * 0.05).half().float() if not signed else torch.full((n, groups), -0.0)
    return q.to(torch.int8), d, m


def _dense(q, d, m):
    g = q.shape[1] // d.shape[1]
    return d.repeat_interleave(g, 1) * q.float() + m.repeat_interleave(g, 1)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("n,k,groups", [(960, 576, 18), (40, 64, 2), (576, 1536, 48), (20, 160, 2), (50, 96, 1)])
@pytest.mark.parametrize("signed", [False, True], ids=["q4_1", "q8_0"])
def test_block_linear_bit_identical_to_packed(isa, n, k, groups, signed):
    """Every row count (in-register tiles of 8 rows, of 9-16 and of two 8-12 up to 24, scratch panels, remainders,
    two row blocks), groups other than 32 (k=160 in groups of 80, k=96 in one), N not a multiple of 16 or 48: the
    same bits as packed_linear on the dequantized weight, and within float32 rounding of float64."""
    q, d, m = _blocks(n, k, groups, signed)
    w = _dense(q, d, m)
    qp, dp, mp = pack_blocks(q, d, m)  # its layout is checked here against pack_weight's (tests/test_packed_linear.py)
    wp = pack_weight(w)
    bias = torch.randn(n)
    for rows in (1, 3, 4, 5, 8, 9, 12, 16, 17, 24, 25, 100, 400):
        x = torch.randn(rows, k)
        a, b = torch.empty(rows, n), torch.empty(rows, n)
        OPS.packed_linear(x, wp, bias, a, isa)
        OPS.block_linear(x, qp, dp, mp, bias, b, isa)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (rows, float((a - b).abs().max()))
        ref = x.double() @ w.double().T + bias.double()
        bound = (x.double().abs() @ w.double().abs().T) * 1e-6 * k ** 0.5 + 1e-6
        assert ((b.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("isa", LEVELS)
def test_block_linear_sees_every_block(isa):
    """A deliberately wrong block (one d doubled, one m changed) changes the output: the test above compares
    values the kernel really reads, and a kernel that skipped m or mixed up groups would fail it."""
    q, d, m = _blocks(48, 128, 4, signed=False)
    x = torch.randn(9, 128)
    outs = []
    for change in (None, "d", "m"):
        dd, mm = d.clone(), m.clone()
        if change == "d":
            dd[17, 3] *= 2
        if change == "m":
            mm[40, 1] += 0.5
        qp, dp, mp = pack_blocks(q, dd, mm)
        out = torch.empty(9, 48)
        OPS.block_linear(x, qp, dp, mp, None, out, isa)
        outs.append(out)
    assert not torch.equal(outs[0][:, 17], outs[1][:, 17]) and torch.equal(outs[0][:, :17], outs[1][:, :17])
    assert not torch.equal(outs[0][:, 40], outs[2][:, 40]) and torch.equal(outs[0][:, :40], outs[2][:, :40])


def test_block_linear_checks_shapes():
    q, d, m = pack_blocks(*_blocks(32, 64, 2, signed=False))
    out = torch.empty(2, 32)
    with pytest.raises(ValueError, match="d and m"):
        OPS.block_linear(torch.randn(2, 64), q, d[:, :1].contiguous(), m, None, out, 2)
    with pytest.raises(ValueError, match="K="):
        OPS.block_linear(torch.randn(2, 65), q, d, m, None, out, 2)


def test_block_linear_module_weight_and_forward():
    q, d, m = _blocks(35, 64, 2, signed=False)
    lin = nn.Linear(64, 35)
    lin.weight.data = _dense(q, d, m)
    mod = BlockLinear(lin, (q, d, m))
    assert torch.equal(mod.weight, lin.weight)
    x = torch.randn(2, 3, 64)
    assert torch.equal(mod(x), PackedLinear(lin)(x))


@pytest.fixture(scope="module")
def gguf_engine(smollm2_engine):
    """The shared SmolLM2 engine: gemm_backend 'auto' keeps a .gguf model's blocks on an AVX2 CPU."""
    return smollm2_engine


@pytest.fixture(scope="module")
def cpu_engine():
    from engine.engine import Engine

    eng = Engine(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=512, max_model_len=2048,
                 gemm_backend="cpu")
    yield eng
    eng.shutdown()
    eng.check_invariants()


def test_smollm2_keeps_every_layer_in_blocks(gguf_engine, cpu_engine):
    """'auto' chose the blocks; every linear layer of SmolLM2 (q/k/v fused, gate/up fused, the tied Q8_0 LM head)
    found in the file and dequantizing to the float32 weight the 'cpu' engine loaded, bit for bit; ~3x less weight
    memory."""
    model, ref = gguf_engine.core.model, cpu_engine.core.model
    assert model.block_layer_counts == {"blocks": 121, "float32": 0}
    blocks = {name: mod for name, mod in model.named_modules() if isinstance(mod, BlockLinear)}
    dense = {name: mod for name, mod in ref.named_modules() if isinstance(mod, PackedLinear)}
    assert blocks.keys() == dense.keys() and len(blocks) == 121
    for name, mod in blocks.items():
        assert torch.equal(mod.weight.view(torch.int32), dense[name].weight.view(torch.int32)), name
    size = lambda m: sum(b.numel() * b.element_size() for b in m.buffers())  # noqa: E731
    assert size(model) * 3 < size(ref)


def test_smollm2_gguf_backend_same_outputs(gguf_engine, cpu_engine):
    """Same greedy tokens and the same log-probs (bit for bit) as the packed float32 engine, decode batches of
    several rows and a ~120-token prompt (the scratch path of the kernel) included."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, " * 20]
    got, want = gguf_engine.generate(prompts, params), cpu_engine.generate(prompts, params)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_layer_without_blocks_stays_float32():
    """A layer whose weight the file does not hold (here: one value changed) is not swapped: it stays a
    PackedLinear, and the others still use the file's blocks."""
    from engine.loader import _load_gguf, smollm2_gguf_path

    model, _, _ = _load_gguf(smollm2_gguf_path(), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        model.layers[3].mlp.down_proj.weight[5, 7] += 1.0
    block_linears(model)
    assert isinstance(model.layers[3].mlp.down_proj, PackedLinear)
    assert isinstance(model.layers[4].mlp.down_proj, BlockLinear)
    assert model.block_layer_counts == {"blocks": 120, "float32": 1}


def test_gguf_backend_needs_a_gguf_model(make_engine):
    with pytest.raises(ValueError, match="gemm_backend='gguf'.*not loaded from a .gguf"):
        make_engine(gemm_backend="gguf")
    with pytest.raises(ValueError, match="gemm_backend"):
        make_engine(gemm_backend="gguf", quantization="int8")


def test_index_matches_rows_by_bits():
    """BlockIndex returns blocks only when they reproduce the weight's bits (a row the file lacks: None)."""
    from engine.loader import smollm2_gguf_path

    index = BlockIndex(smollm2_gguf_path())
    q, d, m = index.tensors[1]
    w = dequantize(q[:5], d[:5], m[:5])
    found = index.blocks_for(w)
    assert found is not None and torch.equal(dequantize(*found), w)
    w[2, 0] = torch.nextafter(w[2, 0], torch.tensor(10.0))
    assert index.blocks_for(w) is None

"""vLLM's sampling options against an independent float64 reference: logit_bias, repetition / frequency / presence
penalties, min_p (with temperature, top-k, top-p), batched over rows with different settings and histories; in the
engine, every token a request gets is the one the reference picks from the same logits and the same uniform; and
prompt_logprobs against HF transformers' teacher-forced log-probabilities."""
from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.logits_processors import process
from engine.sampler import sample, sampling_probs


# ---------------------------------------------------------------------------------------------- the reference
def reference_logits(logits, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """float64, one row, token by token: vLLM's order (bias, repetition, frequency, presence)."""
    x = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    seen = set(prompt) | set(output)
    for t in range(x.numel()):
        if p.repetition_penalty != 1 and t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        count = output.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


def reference_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 distribution after temperature, min_p, top-k and top-p (one-hot argmax when greedy)."""
    if p.greedy:
        out = torch.zeros_like(x)
        out[int(x.argmax())] = 1
        return out
    x = x / p.temperature
    probs = x.softmax(-1)
    x = torch.where(probs < p.min_p * probs.max(), torch.full_like(x, float("-inf")), x)
    order = x.argsort(descending=True, stable=True)
    keep = torch.zeros(x.numel(), dtype=torch.bool)
    keep[order[:p.top_k or x.numel()]] = True
    x = torch.where(keep, x, torch.full_like(x, float("-inf")))
    probs = x.softmax(-1)
    sorted_p = probs[order]
    mass_before = sorted_p.cumsum(0) - sorted_p
    drop = order[mass_before >= p.top_p]
    probs[drop] = 0
    return probs / probs.sum()


def reference_token(x: torch.Tensor, p: SamplingParams, u: float) -> int:
    probs = reference_probs(x, p)
    if p.greedy:
        return int(probs.argmax())
    order = x.argsort(descending=True, stable=True)
    cdf = probs[order].cumsum(0)
    return int(order[min(int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64))),
                         x.numel() - 1)])


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0, 0.5, 1.0, 1.7]), top_k=rng.choice([0, 5, 20]), top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05, 0.3]), repetition_penalty=rng.choice([1.0, 1.3, 0.7, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.5, -0.5, 2.0]), presence_penalty=rng.choice([0.0, 0.8, -1.0]),
        logit_bias=rng.choice([None, {rng.randrange(vocab): 5.0, rng.randrange(vocab): -100.0}]))


@pytest.mark.parametrize("seed", range(6))
def test_batched_processing_and_distributions_equal_the_float64_reference(seed):
    rng = random.Random(seed)
    B, V = 12, 64
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3
    params = [_random_params(rng, V) for _ in range(B)]
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 9))] for _ in range(B)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 12))] for _ in range(B)]
    got = logits.clone()
    process(got, params, prompts, outputs, [[] for _ in range(B)])
    for i in range(B):
        ref = reference_logits(logits[i], params[i], prompts[i], outputs[i])
        torch.testing.assert_close(got[i].double(), ref, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(sampling_probs(got[i:i + 1], [params[i]])[0].double(),
                                   reference_probs(ref, params[i]), atol=2e-6, rtol=1e-5)
    # the batched draw picks the reference's token for the same uniforms
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(B)]
    tokens = sample(got, params, gens)
    for i in range(B):
        u = float(torch.rand((), generator=torch.Generator().manual_seed(1000 + i)))
        ref = reference_logits(logits[i], params[i], prompts[i], outputs[i])
        assert int(tokens[i]) == reference_token(ref, params[i], u), i


def test_a_wrong_penalty_order_is_caught_by_the_reference():
    """Presence before repetition is a different rule: the reference comparison above would fail on it."""
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)
    x = torch.tensor([1.5, -0.5, 0.2])
    ref = reference_logits(x, p, prompt=[0], output=[0, 1])
    wrong = x.double().clone()
    wrong[[0, 1]] -= 1.0  # presence first
    wrong = torch.where(torch.tensor([True, True, False]), torch.where(wrong > 0, wrong / 2, wrong * 2), wrong)
    assert not torch.allclose(ref, wrong)


def _recording(monkeypatch):
    """Record, for every sampled row, the sequence, its outputs so far and the raw logits the sampler got."""
    from engine.sampler import Sampler

    seen = []
    real = Sampler.sample

    def record(self, seqs, logits):
        for i, s in enumerate(seqs):
            seen.append((s, list(s.output_token_ids), logits[i].detach().double().clone()))
        return real(self, seqs, logits)

    monkeypatch.setattr(Sampler, "sample", record)
    return seen


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_engine_token_is_the_references(make_engine, monkeypatch, temperature):
    eng = make_engine()
    seen = _recording(monkeypatch)
    params = [SamplingParams(temperature=temperature, seed=11 + i, max_tokens=30, ignore_eos=True, **kw)
              for i, kw in enumerate([
                  dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
                  dict(logit_bias={7: 4.0, 9: -100.0}, min_p=0.1),
                  dict(frequency_penalty=2.0, top_k=10, top_p=0.8),
                  dict()])]
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 5, 5], [20, 21, 22], [30, 31, 32, 33]]
    outs = eng.generate(prompts, params, use_tqdm=False)
    draws = {}
    checked = 0
    for seq, before, raw in seen:
        p = seq.params
        gen = draws.setdefault(seq.seq_id, torch.Generator().manual_seed(p.seed))
        u = float(torch.rand((), generator=gen)) if not p.greedy else 0.0
        want = reference_token(reference_logits(raw, p, seq.prompt_token_ids, before), p, u)
        assert seq.output_token_ids[len(before)] == want, (p, len(before))
        checked += 1
    assert checked == 4 * 30
    # and the options matter: without them the same prompts give other tokens
    plain = eng.generate(prompts, [SamplingParams(temperature=temperature, seed=11 + i, max_tokens=30,
                                                  ignore_eos=True) for i in range(4)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] != [o.outputs[0].token_ids for o in plain[:3]]
    assert 9 not in outs[1].outputs[0].token_ids


@pytest.mark.parametrize("kw,param", [({"presence_penalty": 3}, "presence_penalty"),
                                      ({"frequency_penalty": -2.5}, "frequency_penalty"),
                                      ({"repetition_penalty": 0}, "repetition_penalty"),
                                      ({"min_p": 1.5}, "min_p"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                                      ({"prompt_logprobs": -1}, "prompt_logprobs")])
def test_bad_values_name_their_field(kw, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kw)
    assert info.value.param == param


def test_logit_bias_ids_are_bounded_by_the_vocabulary(make_engine):
    eng = make_engine()
    with pytest.raises(InvalidRequestError) as info:
        eng.new_request([5, 6], SamplingParams(logit_bias={10**6: 1.0}))
    assert info.value.param == "logit_bias"
    assert SamplingParams(logit_bias={"3": 250}).logit_bias == {3: 100.0}  # JSON keys; clamped as in vLLM


def test_prompt_logprobs_equal_hf_teacher_forced_logprobs(make_engine, tiny_hf_llama):
    eng = make_engine()
    prompt = [5, 9, 13, 17, 21, 25, 29, 33, 37]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    with torch.no_grad():
        ref = tiny_hf_llama(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == len(prompt)
    for t in range(1, len(prompt)):
        logps, rank = pl[t]
        assert next(iter(logps)) == prompt[t]
        assert logps[prompt[t]] == pytest.approx(float(ref[t - 1, prompt[t]]), abs=1e-4)
        top = ref[t - 1].topk(3)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            assert logps[tid] == pytest.approx(val, abs=1e-4)
        assert rank == int((ref[t - 1] > ref[t - 1, prompt[t]]).sum()) + 1

"""What an 8-bit K or V row costs, scheme by scheme: a study through HF transformers' own attention, with K and V
rounded the way each scheme would store them, to see which term holds int8 pages back and what would reach bfloat16.

    python -m bench.kv_quant_schemes [--prompts 64] [--prompt-len 24] [--max-tokens 64]

SmolLM2 (its GGUF dequantized to a float32 HF directory, bench.vllm_env.ensure_model_dir), float32, eager attention.
The float32 model's greedy continuations of `--prompts` licence-text windows are scored teacher-forced, once per
scheme: K and V (after RoPE, as the cache holds them) pass through the scheme's round trip inside the attention call,
so every position reads rounded rows, as it would from pages. Reported: mean and p99 KL(float32 || scheme) of the
next-token distribution, and how often the top token stays float32's. The schemes that kvllm's pages do not store
(rotated, asymmetric, grouped, per-channel) are here to name what would close the gap, not as a claim about the engine.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from bench.common import text_prompts, write_section

SECTION = "8-bit K and V rows, scheme by scheme (teacher-forced KL, SmolLM2)"


def hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix: q.k is unchanged when both are rotated, and outlier channels spread."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def int8_rows(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Symmetric int8 round trip, one scale per row (or per `group` values of a row): the engine's int8 pages."""
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    s = x.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return ((x / s).round().clamp(-127, 127) * s).reshape(shape)


def int8_rows_asym(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = ((hi - lo) / 255).clamp_min(1e-12)
    return ((x - lo) / s).round().clamp(0, 255) * s + lo


def int8_channels(x: torch.Tensor) -> torch.Tensor:
    """One scale per channel over the whole sequence (KIVI's K, arXiv 2402.02750): not storable in a row."""
    s = x.abs().amax(-2, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (x / s).round().clamp(-127, 127) * s


def fp8_rows(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (x / s).clamp(-qmax, qmax).to(dtype).float() * s


def schemes(d: int) -> dict[str, tuple]:
    h = hadamard(d)
    same = None
    rot = lambda f: (lambda x: f(x @ h) @ h.T)  # noqa: E731
    bf16 = lambda x: x.bfloat16().float()  # noqa: E731
    return {  # name -> (K round trip, V round trip)
        "bfloat16 K, bfloat16 V": (bf16, bf16),
        "int8 K, int8 V (one scale per row, K unrotated)": (int8_rows, int8_rows),
        "fp8_e4m3 K, fp8_e4m3 V (kvllm's pages)": (lambda x: fp8_rows(x, torch.float8_e4m3fn, 448.0),
                                                   lambda x: fp8_rows(x, torch.float8_e4m3fn, 448.0)),
        "int8 K only": (int8_rows, same),
        "int8 V only": (same, int8_rows),
        "bfloat16 K, int8 V": (bf16, int8_rows),
        "int8 K rotated (Hadamard), int8 V (kvllm's int8 pages)": (rot(int8_rows), int8_rows),
        "int8 K asymmetric, int8 V": (int8_rows_asym, int8_rows),
        "int8 K, a scale per 16 values, int8 V": (lambda x: int8_rows(x, 16), int8_rows),
        "int8 K per channel (KIVI), int8 V": (int8_channels, int8_rows),
        "int8 K rotated + asymmetric, int8 V": (rot(int8_rows_asym), int8_rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama import modeling_llama

    from bench.vllm_env import ensure_model_dir

    t0 = time.perf_counter()
    model_dir = ensure_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = torch.tensor(text_prompts(tok, args.prompts, args.prompt_len, seed=1))
    plain = modeling_llama.eager_attention_forward
    active: list = [None, None]

    def rounded(module, query, key, value, *a, **kw):
        k_fn, v_fn = active
        return plain(module, query, k_fn(key) if k_fn else key, v_fn(value) if v_fn else value, *a, **kw)

    def next_token_logprobs(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[:, args.prompt_len - 1:-1].float(), -1)

    modeling_llama.eager_attention_forward = rounded
    try:
        with torch.no_grad():
            # min_new_tokens: every row runs its full length (no EOS, no padding scored)
            ids = model.generate(prompts, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                 do_sample=False, attention_mask=torch.ones_like(prompts))
        ref = next_token_logprobs(ids)
        lines = ["| K / V rows | mean KL (nats) | p99 KL | top token kept | KL / bfloat16's |",
                 "|---|---:|---:|---:|---:|"]
        base = None
        for name, fns in schemes(model.config.head_dim).items():
            active[:] = fns
            lp = next_token_logprobs(ids)
            kl = (ref.exp() * (ref - lp)).sum(-1).flatten()
            kept = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
            base = base or max(kl.mean().item(), 1e-30)
            lines.append(f"| {name} | {kl.mean():.2e} | {kl.quantile(0.99):.2e} | {100 * kept:.2f}% | "
                         f"{kl.mean().item() / base:.1f}x |")
            print(lines[-1], file=sys.stderr, flush=True)
    finally:
        modeling_llama.eager_attention_forward = plain
    body = "\n".join(lines) + "\n\n" + (
        f"SmolLM2-135M-Instruct (float32 HF model, eager attention), {args.prompts} licence-text prompts of "
        f"{args.prompt_len} tokens, scored teacher-forced along float32's own {args.max_tokens}-token greedy "
        f"continuations ({ids.shape[0] * args.max_tokens} positions); K and V after RoPE pass through each scheme's "
        f"round trip before attention reads them. Rotated: K times a {model.config.head_dim}x{model.config.head_dim} "
        f"Hadamard matrix before rounding (queries would be rotated alike, so q.k is unchanged). Per channel: one "
        f"scale per channel over the sequence, which a per-row page cannot store. {time.perf_counter() - t0:.0f} s.")
    print(body)
    if not args.no_write:
        write_section(SECTION, "python -m bench.kv_quant_schemes " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()

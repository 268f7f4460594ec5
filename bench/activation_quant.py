"""What 8-bit activations would cost: the one way above this CPU's bfloat16 multiply-add ceiling (vpdpbusd does twice
the multiply-adds of vdpbf16ps per instruction) needs both GEMM operands in 8 bits. Text NLL of SmolLM2 (HF
transformers, float32, the GGUF dequantized) with every linear layer's weights and inputs rounded as such a GEMM
would see them, over float32.

    python -m bench.activation_quant [--chunks 12] [--no-write]

Rows: bfloat16 weights and inputs (what `--dtype auto`'s bf16 panels multiply); int8 weights per output channel
alone (weight-only, as `--quantization int8`); then int8 inputs as well, one scale per token or per block of 64 or
32 input channels (symmetric, round to nearest). The LM head is rounded like the others, the embedding kept
float32. Teacher-forced over `chunks` chunks of 512 tokens of the licence texts.
"""
from __future__ import annotations

import argparse
import time

from bench.common import cpu_name, real_text, write_section

SECTION = "8-bit activations: what lifting the GEMM ceiling would cost (SmolLM2)"
CHUNK = 512
# (row, weights, input scale block: None = inputs untouched, 0 = one scale per token, n = per n input channels)
SCHEMES = [("float32", "float32", None), ("bfloat16 weights and inputs", "bfloat16", "bfloat16"),
           ("int8 weights (per channel)", "int8", None), ("int8 weights, int8 inputs per token", "int8", 0),
           ("int8 weights, int8 inputs per 64 channels", "int8", 64),
           ("int8 weights, int8 inputs per 32 channels", "int8", 32)]


def int8_round(x, block: int):
    """x rounded to symmetric int8 with one scale per `block` trailing channels (0: per row), back in float."""
    import torch

    shape = x.shape
    xb = x.unsqueeze(-2) if block == 0 else x.reshape(*shape[:-1], shape[-1] // block, block)
    scale = xb.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny) / 127
    return (torch.round(xb / scale).clamp(-127, 127) * scale).reshape(shape)


def run(chunks: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.vllm_env import ensure_model_dir

    src = ensure_model_dir()
    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie: embedding stays
    ids = tok(real_text(), return_tensors="pt").input_ids[0]
    batches = [ids[i * CHUNK:(i + 1) * CHUNK] for i in range(chunks)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    exact = {m: m.weight.detach().clone() for m in linears}
    state = {"inputs": None}

    def round_inputs(_module, args):
        x, how = args[0], state["inputs"]
        if how is None:
            return None
        return (x.bfloat16().float() if how == "bfloat16" else int8_round(x, how),)

    for m in linears:
        m.register_forward_pre_hook(round_inputs)
    rows = []
    for name, weights, inputs in SCHEMES:
        for m in linears:
            w = exact[m]
            m.weight.data = (w if weights == "float32" else w.bfloat16().float() if weights == "bfloat16"
                             else int8_round(w, 0))
        state["inputs"] = inputs
        total, count = 0.0, 0
        with torch.no_grad():
            for chunk in batches:
                logits = model(chunk[None]).logits[0, :-1]
                total += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
                count += len(chunk) - 1
        rows.append({"scheme": name, "nll": total / count})
        print(f"  {name}: {total / count:.5f}", flush=True)
    return {"rows": rows, "tokens": count, "chunks": chunks}


def render(res: dict) -> str:
    ref = res["rows"][0]["nll"]
    lines = ["| weights and GEMM inputs | text NLL (nats / token) | over float32 |", "|---|--:|--:|"]
    for r in res["rows"]:
        lines.append(f"| {r['scheme']} | {r['nll']:.4f} | {100 * (r['nll'] / ref - 1):+.2f}% |")
    return ("\n".join(lines) + f"\n\n{cpu_name()}; SmolLM2-135M-Instruct (the GGUF dequantized to float32, HF "
            f"transformers), teacher-forced over {res['chunks']} chunks of {CHUNK} tokens of the licence texts "
            f"({res['tokens']} predictions); every linear layer's weight and input rounded as the row says, the "
            "products and sums in float32. int8: symmetric, round to nearest, scale = max |x| / 127 over the "
            "channel, token or block.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res = run(args.chunks)
    body = render(res) + f" {time.perf_counter() - t0:.0f} s."
    print(body)
    if not args.no_write:
        write_section(SECTION, "python -m bench.activation_quant" +
                      (f" --chunks {args.chunks}" if args.chunks != 12 else ""), body)


if __name__ == "__main__":
    main()

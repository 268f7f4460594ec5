"""Offline throughput: kvllm vs HF transformers `generate` on SmolLM2 (CPU), both in the same dtype, in one process.

64 requests, 256-token prompts of real text, 256 new tokens with ignore_eos, greedy. HF runs static batches of
the same size. Also measures the bare matmul floor of one decode step (every linear layer + LM head at
the batch size, no attention or norms) so the engine's overhead over pure GEMM time is visible.

    .venv/bin/python -m bench.offline_throughput [--num-prompts 64] [--input-len 256] [--output-len 256]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import median, run_requests, text_prompts, write_section  # noqa: E402
from engine import Engine, SamplingParams  # noqa: E402


def kvllm_run(engine: Engine, prompts, output_len: int, batch: int) -> tuple[float, float]:
    """Output tok/s with at most `batch` sequences running, and mean decode step time (s) at full batch."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    outs, elapsed = run_requests(engine, prompts, params, batch, prefix=f"b{batch}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * output_len
    engine.check_invariants()
    return tokens / elapsed, elapsed


def decode_step_time(engine: Engine, prompts, batch: int, steps: int = 8) -> float:
    """Median time of a pure decode step with `batch` running sequences."""
    # long enough that the first sequences are still decoding when the last prompt's chunked prefill ends
    prompt_tokens = sum(len(p) for p in prompts[:batch])
    prefill_steps = prompt_tokens // engine.config.max_num_batched_tokens + 2
    params = SamplingParams(temperature=0, max_tokens=prefill_steps + steps + 4, ignore_eos=True)
    base = engine.stats().prompt_tokens_total
    for i, p in enumerate(prompts[:batch]):
        engine.add_request(p, params, f"probe-{i}")
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        st = engine.stats()  # every prompt prefilled and all sequences running: a pure decode step
        if st.num_running == batch and st.prompt_tokens_total - base >= prompt_tokens:
            times.append(dt)
    if not times:
        raise RuntimeError(f"never had {batch} sequences decoding together (KV pool too small?)")
    return median(times[1:] or times)


def hf_run(model, prompts, output_len: int, batch: int) -> float:
    total, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch])  # all prompts have the same length: no padding
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return total / (time.perf_counter() - t0)


def matmul_floor(engine: Engine, batch: int, repeats: int = 10, lm_head: bool = True) -> float:
    """Seconds for the bare GEMMs (model dtype) of one decode step: x[batch, in] @ W.T for every linear + LM head
    (without the LM head: the GEMMs of a prefill chunk of `batch` tokens, which needs logits only at its end)."""
    vocab = engine.model_config.vocab_size
    weights = [m.weight for m in engine.model.modules() if isinstance(m, torch.nn.Linear)
               and (lm_head or m.weight.shape[0] != vocab)]
    hidden = engine.model_config.hidden_size
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=engine.dtype) for w in weights}
    xh = torch.randn(batch, hidden, dtype=engine.dtype)
    has_lm_head = any(w.shape[0] == engine.model_config.vocab_size for w in weights)
    lm_weight = None if has_lm_head or not lm_head else (
        engine.model.embed_tokens.weight if hasattr(engine.model, "embed_tokens") else None)

    def once():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        if lm_weight is not None:
            torch.nn.functional.linear(xh, lm_weight)

    with torch.inference_mode():
        once()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    return median(times)


def prefix_caching_rows(args) -> str:
    """The workload with a shared system prompt in front of every request, prefix caching on vs off: output tok/s and
    the median / p90 time to first token (arrival to first token, from each RequestOutput's metrics)."""
    rows = []
    for on in (False, True):
        engine = Engine(model="smollm2", dtype=args.dtype, device="cpu", max_num_seqs=64,
                        max_num_batched_tokens=2048, max_model_len=2048, enable_prefix_caching=on)
        system = text_prompts(engine.tokenizer, 1, args.prefix_len, seed=1)[0]
        prompts = [system + p for p in text_prompts(engine.tokenizer, args.num_prompts, args.input_len)]
        kvllm_run(engine, [p[-8:] for p in prompts[:4]], 4, 4)  # warm-up that caches nothing of the workload
        engine.reset_stats()
        params = SamplingParams(temperature=0, max_tokens=args.prefix_output_len, ignore_eos=True)
        outs, wall = run_requests(engine, prompts, params, 64, prefix="p")
        ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
        st = engine.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        hit = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
        rows.append((on, tokens / wall, median(ttft), ttft[int(0.9 * (len(ttft) - 1))], hit, st.prompt_tokens_total))
        del engine
    lines = ["| prefix caching | output tok/s | median TTFT | p90 TTFT | prompt tokens computed | prefix hit rate |",
             "|---|---:|---:|---:|---:|---:|"]
    for on, tps, t50, t90, hit, computed in rows:
        lines.append(f"| {'on' if on else 'off'} | {tps:.1f} | {t50:.1f} s | {t90:.1f} s | {computed} "
                     f"| {100 * hit:.0f}% |")
    return "\n".join(lines) + (
        f"\n\n{args.num_prompts} requests, each a shared {args.prefix_len}-token system prompt + its own "
        f"{args.input_len}-token real-text prompt, {args.prefix_output_len} new tokens (greedy, ignore_eos), all "
        f"submitted at once (TTFT includes queueing); {torch.get_num_threads()} CPU thread(s). With prefix caching "
        f"the system prompt is computed by the first requests admitted and taken from the cache by the rest.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-only", action="store_true", help="only the prefix-caching rows")
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--prefix-output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--hf-num-prompts", type=int, default=32, help="HF runs this many prompts (a rate is measured)")
    ap.add_argument("--dtype", default="auto", help="auto = bf16 only where the CPU has fast bf16 (AMX)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefix_only:
        body = prefix_caching_rows(args)
        print(body)
        if not args.no_write:
            write_section("Prefix caching (shared system prompt)", "python -m bench.offline_throughput "
                          + " ".join(sys.argv[1:]), body)
        return

    engine = Engine(model="smollm2", dtype=args.dtype, device="cpu", max_num_seqs=64, max_num_batched_tokens=2048,
                    max_model_len=2048)
    prompts = text_prompts(engine.tokenizer, args.num_prompts, args.input_len)
    kvllm_run(engine, prompts[:4], 8, 4)  # warm-up
    rows = []
    tps32, _ = kvllm_run(engine, prompts, args.output_len, 32)
    tps64, _ = kvllm_run(engine, prompts, args.output_len, 64)
    probe = min(64, len(prompts))
    # the decode step at the start of the workload's decode (KV ~ input_len) and near its end (~ input + output)
    step_start = decode_step_time(engine, prompts, probe)
    long_prompts = text_prompts(engine.tokenizer, probe, args.input_len + args.output_len - 16)
    step_end = decode_step_time(engine, long_prompts, probe)
    floor64 = matmul_floor(engine, probe)
    # Lower bound on kvllm's time for HF's requests at HF's batch size: the bare GEMMs of their prefill plus
    # output_len decode steps at that batch. HF's time over it is the most kvllm / HF can be on this machine.
    chunk = 2048
    prefill_floor = matmul_floor(engine, chunk, repeats=3, lm_head=False) * args.input_len / chunk  # s per prompt
    decode_floor = matmul_floor(engine, args.hf_batch)  # s per decode step at HF's batch
    hf_tps = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from engine.loader import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=engine.dtype).eval()
        hf_run(hf, prompts[:2], 4, 2)  # warm-up
        hf_tps = hf_run(hf, prompts[:args.hf_num_prompts], args.output_len, args.hf_batch)
    rows.append(("kvllm, max 32 running", f"{tps32:.1f}", f"{tps32 / hf_tps:.2f}x" if hf_tps else "-"))
    rows.append(("kvllm, max 64 running", f"{tps64:.1f}", f"{tps64 / hf_tps:.2f}x" if hf_tps else "-"))
    if hf_tps:
        rows.append((f"HF transformers generate, static batch {args.hf_batch}", f"{hf_tps:.1f}", "1.00x"))
    table = ["| system | output tok/s | vs HF |", "|---|---:|---:|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    table += ["", f"| decode step at {probe} running (median) | KV slots per sequence | bare GEMM floor of that step "
                  f"| ratio |", "|---|---:|---:|---:|",
              f"| start of decode | ~{args.input_len} | {floor64 * 1e3:.1f} ms | {step_start / floor64:.2f}x "
              f"({step_start * 1e3:.1f} ms) |",
              f"| end of decode | ~{args.input_len + args.output_len} | {floor64 * 1e3:.1f} ms | {step_end / floor64:.2f}x "
              f"({step_end * 1e3:.1f} ms) |"]
    if hf_tps:
        n, b = args.hf_num_prompts, args.hf_batch
        hf_time = n * args.output_len / hf_tps
        floor_time = prefill_floor * n + decode_floor * args.output_len * -(-n // b)
        table += ["", f"| HF time for its {n} requests | GEMM floor: their prefill + {args.output_len} decode steps at "
                  f"batch {b} | ceiling on kvllm / HF at batch {b} |", "|---:|---:|---:|",
                  f"| {hf_time:.1f} s | {prefill_floor * n:.1f} s + {decode_floor * args.output_len * -(-n // b):.1f} s "
                  f"| {hf_time / floor_time:.2f}x |"]
    body = "\n".join(table)
    body += (f"\n\nSmolLM2-135M-Instruct (Q4_1 GGUF dequantized to {engine.dtype}), {args.num_prompts} requests x "
             f"{args.input_len}-token real-text prompts, {args.output_len} new tokens, greedy, ignore_eos; "
             f"{torch.get_num_threads()} CPU thread(s); HF runs {args.hf_num_prompts} of the prompts.")
    print(body)
    if not args.no_write:
        cmd = "python -m bench.offline_throughput " + " ".join(sys.argv[1:])
        write_section("Offline throughput (kvllm vs HF transformers)", cmd.strip(), body)


if __name__ == "__main__":
    main()

"""Decode speed of a Llama-3-8B-shaped model (random bf16 weights) on one GPU, and Kara's time per round.

    python -m bench.gpu_decode_bench                      # what bench/gpu_check.sh runs on the H200
    python -m bench.gpu_decode_bench --device cpu --backend torch --layers 2 --hidden 256 --heads 4 \
        --kv-heads 2 --head-dim 64 --intermediate 512 --vocab 1000 --batch-sizes 1,4 --context 64 \
        --window 32 --buffer 8 --kara-seqs 2 --no-graphs   # CPU smoke run of the script itself

Decode: every sequence has a `--context`-token KV (random contents: the kernels' work does not depend on
the values) and decodes one token per step; TPOT is the wall time of a whole step (metadata + plan +
forward + logits + greedy pick + the host sync a sampler does), eager and with decode CUDA graphs.
Achieved bandwidth = (weight bytes + KV bytes read per step) / TPOT, next to a measured device-to-device
copy (bytes read + written per second). When the KV of every sequence does not fit in memory, sequences
past the ones that fit reuse their pages (said in the note column): the bytes counted are still read.

Kara round: for `--kara-seqs` sequences at a time: recompute the |W| window's queries through the model
(write=False attention), Kara scores + Token2Chunk (compression.kara, all sequences x layers batched), and
paging.compaction.compact_batch; each part timed separately.

Writes a markdown report to stdout and, if $OUT is set, to $OUT/gpu_bench.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

from compression import KVCompressionConfig  # noqa: E402
from compression.kara import Kara  # noqa: E402
from engine.attention import get_backend  # noqa: E402
from engine.attention.base import build_metadata  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.llama import DecoderLM, Rotary  # noqa: E402
from paging.compaction import CompactionJob, compact_batch  # noqa: E402
from paging.kv_cache import KVCache, bytes_per_block  # noqa: E402

GiB = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="flashinfer", choices=["flashinfer", "torch", "auto"])
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--context", type=int, default=4096, help="KV tokens per sequence at the first timed step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reserve-gib", type=float, default=6.0, help="GPU memory left free for activations")
    p.add_argument("--no-graphs", action="store_true", help="skip the decode CUDA-graph timings")
    p.add_argument("--window", type=int, default=512, help="Kara |W|")
    p.add_argument("--buffer", type=int, default=64, help="Kara |U|")
    p.add_argument("--kara-seqs", default="16,64", help="sequences per compression round")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_config(a) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=a.vocab, hidden_size=a.hidden,
                       intermediate_size=a.intermediate, num_layers=a.layers, num_q_heads=a.heads,
                       num_kv_heads=a.kv_heads, head_dim=a.head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
                       max_position_embeddings=a.context + 1024)


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> DecoderLM:
    """Random weights made directly on the device in `dtype` (an 8B model never touches host memory)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderLM(config)
    finally:
        torch.set_default_dtype(default)
    model.rotary = Rotary(config)  # its host-side tables must not be built under the device context
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    n = 10
    for _ in range(n):
        y.copy_(x)
    sync(device)
    dt = (time.perf_counter() - t0) / n
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the memory back: the KV cache is sized from what is free
    return 2 * nbytes / dt


def weight_bytes_per_step(model: DecoderLM, batch: int) -> int:
    """Every parameter is read once per decode step, except the embedding table (only `batch` rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    if model.lm_head is not None:  # untied: the embedding table itself is not streamed
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


class DecodeBench:
    """Page tables for `max_batch` sequences over one KV cache; sequences past what fits alias pages."""

    def __init__(self, a, model, config, attn, device, dtype):
        self.a, self.model, self.config, self.attn, self.device, self.dtype = a, model, config, attn, device, dtype
        self.batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
        max_batch = max(self.batch_sizes)
        bs = a.block_size
        max_len = a.context + a.warmup + a.steps + 2  # graph capture adds a step
        self.pages_per_seq = -(-max_len // bs)
        per_block = bytes_per_block(config.num_layers, bs, config.num_kv_heads, config.head_dim, dtype)
        want = max_batch * self.pages_per_seq + 1  # + the scratch block for padded graph rows
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0] - int(a.reserve_gib * GiB)
            num_blocks = max(self.pages_per_seq + 1, min(want, free // per_block))
        else:
            num_blocks = want
        self.kv = KVCache(config.num_layers, num_blocks, bs, config.num_kv_heads, config.head_dim, dtype, device)
        for layer in self.kv.layers:
            layer.normal_()
        self.scratch = num_blocks - 1
        self.distinct = (num_blocks - 1) // self.pages_per_seq
        self.tables = [list(range((i % self.distinct) * self.pages_per_seq, (i % self.distinct + 1) *
                                  self.pages_per_seq)) for i in range(max_batch)]
        self.kv_bytes_per_token = (config.num_layers * 2 * config.num_kv_heads * config.head_dim *
                                   torch.empty((), dtype=dtype).element_size())

    def _meta(self, batch, kv_lens):
        return build_metadata(self.tables[:batch], [1] * batch, kv_lens, self.a.block_size, self.device)

    def _plan(self, meta):
        c = self.config
        self.attn.plan(meta, c.num_q_heads, c.num_kv_heads, c.head_dim, self.dtype)

    def run(self, batch: int, graphs: bool) -> dict:
        a, model = self.a, self.model
        kv_lens = [a.context - a.warmup] * batch
        ids = torch.randint(0, self.config.vocab_size, (batch,), device=self.device)
        pos = torch.full((batch,), a.context - a.warmup, dtype=torch.long, device=self.device)
        graph = hidden = None
        if graphs:  # capture at this batch size (the first step doubles as its warm-up)
            static_ids, static_pos = ids.clone(), pos.clone()
            meta = self._meta(batch, kv_lens)
            self.attn.plan_graph(meta, batch)
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                model(static_ids, static_pos, self.kv.layers, self.attn, meta)
            torch.cuda.current_stream(self.device).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                hidden = model(static_ids, static_pos, self.kv.layers, self.attn, meta)

        def step():
            nonlocal ids, pos, kv_lens
            meta = self._meta(batch, kv_lens)
            if graph is not None:
                self.attn.plan_graph(meta, batch)
                static_ids.copy_(ids)
                static_pos.copy_(pos)
                graph.replay()
                h = hidden
            else:
                self._plan(meta)
                h = model(ids, pos, self.kv.layers, self.attn, meta)
            ids = model.compute_logits(h).argmax(-1)
            ids.tolist()  # the host sync a sampler does every step
            pos = pos + 1
            kv_lens = [k + 1 for k in kv_lens]

        for _ in range(a.warmup):
            step()
        sync(self.device)
        kv_read = 0
        t0 = time.perf_counter()
        for _ in range(a.steps):
            kv_read += sum(kv_lens) * self.kv_bytes_per_token
            step()
        sync(self.device)
        tpot = (time.perf_counter() - t0) / a.steps
        moved = weight_bytes_per_step(model, batch) + kv_read / a.steps
        del graph, hidden
        return {"tpot": tpot, "tok_s": batch / tpot, "bw": moved / tpot, "moved": moved}


def kara_round(a, model, config, attn, device, dtype, num_seqs: int) -> dict:
    """One compression round over `num_seqs` sequences whose KV holds `--context` tokens."""
    bs, w = a.block_size, a.window
    comp = KVCompressionConfig(window=w, buffer=a.buffer, compression_period=w)
    n = comp.region_len
    L, hkv, hq, d = config.num_layers, config.num_kv_heads, config.num_q_heads, config.head_dim
    pages = -(-a.context // bs)
    kv = KVCache(L, num_seqs * pages, bs, hkv, d, dtype, device)
    for layer in kv.layers:
        layer.normal_()
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(num_seqs)]
    kv_lens = [a.context] * num_seqs
    kara = Kara(comp)
    sync(device)

    t0 = time.perf_counter()
    meta = build_metadata(tables, [w] * num_seqs, kv_lens, bs, device, write=False)
    attn.plan(meta, hq, hkv, d, dtype)
    ids = torch.randint(0, config.vocab_size, (num_seqs * w,), device=device)
    pos = (torch.arange(w, device=device) + a.context - w).repeat(num_seqs)
    queries = model.recompute_queries(ids, pos, kv.layers, attn, meta)  # [L, S*W, Hq, D]
    sync(device)
    t1 = time.perf_counter()

    # sequences x layers stacked on the leading axis: one batched Kara call
    q = queries.view(L, num_seqs, w, hq, d).permute(1, 0, 3, 2, 4).reshape(num_seqs * L, hq, w, d)
    del queries
    slots = torch.arange(a.context - w, a.context, device=device)
    table = torch.tensor(tables, device=device)  # [S, pages]
    blocks = table[:, slots // bs]  # [S, W]
    offsets = (slots % bs).expand(num_seqs, w)
    keys = kv.data[:, blocks, 0, offsets]  # [L, S, W, Hkv, D]
    keys = keys.permute(1, 0, 3, 2, 4).reshape(num_seqs * L, hkv, w, d)
    kept = kara.select(q, keys, n).view(num_seqs, L, hkv, -1)
    sync(device)
    t2 = time.perf_counter()

    jobs = [CompactionJob(tables[i], kv_lens[i] - w, n, kept[i], kv_lens[i]) for i in range(num_seqs)]
    compact_batch(kv.data, jobs, check_indices=False)
    sync(device)
    t3 = time.perf_counter()
    del kv, q, keys, kept
    return {"recompute": t1 - t0, "select": t2 - t1, "compact": t3 - t2, "kept": jobs[0].kept.shape[-1], "n": n}


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    config = model_config(a)
    lines = [f"## GPU decode benchmark ({datetime.date.today().isoformat()})", ""]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fi_version = "-"
    if a.backend != "torch":
        try:
            import flashinfer

            fi_version = flashinfer.__version__
        except Exception as e:  # reported, then get_backend raises the real error
            fi_version = f"not importable: {e}"
    copy_bw = copy_bandwidth(device, 4 * GiB if device.type == "cuda" else 64 << 20)
    attn = get_backend(a.backend, device)
    graphs = not a.no_graphs and device.type == "cuda" and hasattr(attn, "init_cuda_graphs")

    t0 = time.perf_counter()
    model = build_model(config, device, dtype)
    sync(device)
    n_params = sum(p.numel() for p in model.parameters())
    lines += [f"- card: {name}; torch {torch.__version__}; attention backend: {type(attn).__name__} "
              f"(flashinfer {fi_version})",
              f"- model ({config.num_layers} layers, hidden {config.hidden_size}, "
              f"{config.num_q_heads} q / {config.num_kv_heads} kv heads, head_dim {config.head_dim}, "
              f"intermediate {config.intermediate_size}, vocab {config.vocab_size}), {n_params / 1e9:.2f} B "
              f"random {str(dtype).removeprefix('torch.')} params, built in {time.perf_counter() - t0:.1f} s",
              f"- measured copy bandwidth (device-to-device, read + write): {copy_bw / 1e9:.0f} GB/s",
              f"- decode: {a.context}-token contexts (+1 per step), block size {a.block_size}, {a.warmup} warm-up "
              f"+ {a.steps} timed steps; TPOT = whole step incl. metadata, plan and a host sync", ""]

    bench = DecodeBench(a, model, config, attn, device, dtype)
    if graphs:
        attn.init_cuda_graphs(bench.batch_sizes, bench.pages_per_seq, config.num_q_heads, config.num_kv_heads,
                              config.head_dim, dtype, bench.scratch)
    lines += ["| batch | mode | TPOT (ms) | tok/s | bytes/step (GB) | achieved (GB/s) | % of copy BW | note |",
              "|---:|---|---:|---:|---:|---:|---:|---|"]
    for batch in bench.batch_sizes:
        note = "" if batch <= bench.distinct else f"{batch - bench.distinct} seqs reuse pages (HBM)"
        for mode in (["eager", "cuda graph"] if graphs else ["eager"]):
            try:
                r = bench.run(batch, graphs=mode == "cuda graph")
                lines.append(f"| {batch} | {mode} | {r['tpot'] * 1e3:.2f} | {r['tok_s']:.0f} | {r['moved'] / 1e9:.1f} "
                             f"| {r['bw'] / 1e9:.0f} | {100 * r['bw'] / copy_bw:.0f}% | {note} |")
            except Exception as e:  # keep the rest of the report
                lines.append(f"| {batch} | {mode} | failed: {type(e).__name__}: {str(e)[:120]} | | | | | |")
            print(lines[-1], flush=True)
    del bench
    if device.type == "cuda":
        torch.cuda.empty_cache()

    lines += ["", f"Kara compression round (|W| = {a.window}, |U| = {a.buffer}, context {a.context}; "
              "recompute = window queries through the model, select = Kara scores + Token2Chunk, "
              "compact = paging.compaction.compact_batch):", "",
              "| seqs/round | kept/region | recompute (ms) | select (ms) | compact (ms) | total (ms) |",
              "|---:|---:|---:|---:|---:|---:|"]
    sizes = [int(s) for s in a.kara_seqs.split(",")]
    kara_round(a, model, config, attn, device, dtype, min(sizes))  # warm-up (allocator, kernels)
    for s in sizes:
        try:
            r = kara_round(a, model, config, attn, device, dtype, s)
            total = r["recompute"] + r["select"] + r["compact"]
            lines.append(f"| {s} | {r['kept']}/{r['n']} | {r['recompute'] * 1e3:.1f} | {r['select'] * 1e3:.1f} | "
                         f"{r['compact'] * 1e3:.1f} | {total * 1e3:.1f} |")
        except Exception as e:
            lines.append(f"| {s} | failed: {type(e).__name__}: {str(e)[:120]} | | | | |")
        print(lines[-1], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    report = "\n".join(lines) + "\n"
    print("\n" + report)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_bench.md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

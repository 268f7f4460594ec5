"""The engine at tensor_parallel_size=N: rank 0 in this process, N - 1 spawned workers (engine/distributed/).

The reference for TP=N is the same engine at TP=1 (itself checked against Hugging Face elsewhere). Greedy tokens
must be equal, with Kara compression forced on (many rounds, both query sources), under memory pressure (swap,
recompute preemption, compress-before-preempt), and with replicated KV heads; every compaction rank 0 made (which
sequence, its new KV length, which blocks it freed) must be exactly what the worker made on its own KV heads.
`kvllm serve --tensor-parallel-size 2` answers the openai client; a killed worker turns /health to 503 and fails a
pending request. Every test runs under a hard deadline and ends with no worker process left.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import check_every_step
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from helpers_models import die_with_parent, hard_timeout, make_tiny_hf_model, save_tiny_tokenizer, tp_worker_processes
from server_fixtures import openai_client, tiny_server_model_dir  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 320
# a window of 32 slots, 24 compressible, 10 kept (ceil(0.25 * 24) + 4): a round every 24 tokens of each sequence
KARA = {"method": "kara", "window": 32, "buffer": 8, "compression_period": 24, "ratio": 0.25, "chunk_budget": 4,
        "chunk_max": 4}


@pytest.fixture(autouse=True)
def _deadline_and_no_worker_left():
    with hard_timeout(480):
        yield
    left = tp_worker_processes()
    for p in left:
        p.kill()
    assert not left, f"tensor-parallel workers left running: {left}"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """Tiny random Llama (4 q heads, 2 KV heads, 3 layers) with room for 300+ new tokens."""
    path = tmp_path_factory.mktemp("tp-engine-llama")
    make_tiny_hf_model("llama", path, seed=3, config_overrides={"max_position_embeddings": 1024})
    save_tiny_tokenizer(path)
    return path


def build(path: Path, tp: int, **kwargs):
    from engine.engine import Engine

    # no swap space unless asked: check_every_step walks every host block too (1 GiB is ~350k blocks here)
    kwargs = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 256, "swap_space": 0,
              "lossless_host_memory": 0, **kwargs}
    return check_every_step(Engine(model=str(path), tensor_parallel_size=tp, **kwargs))


def random_prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (n,), generator=g).tolist() for n in lengths]


def record_compactions(engine) -> list:
    """Rank 0's compactions as the test sees them: (seq id, KV length after, blocks that left the table)."""
    log = []
    compact = engine.core.kv.compact

    def recording(jobs):
        before = [list(job.seq.block_table) for job in jobs]
        freed = compact(jobs)
        for job, table in zip(jobs, before):
            log.append((job.seq.seq_id, job.seq.kv_len, [b for b in table if b not in job.seq.block_table]))
        return freed

    engine.core.kv.compact = recording
    return log


def run(path: Path, tp: int, prompts, params, **kwargs):
    """Generate on a fresh engine; returns (token ids, stats, rank 0's compactions, worker snapshots)."""
    eng = build(path, tp, **kwargs)
    try:
        log = record_compactions(eng)
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = eng.stats()
        workers = eng.core.driver.inspect() if tp > 1 else []
    finally:
        eng.shutdown()
    print(f"TP={tp}: {sum(len(o.outputs[0].token_ids) for o in outs)} tokens in {seconds:.1f} s, "
          f"{stats.compression.rounds} rounds, {stats.compression.blocks_freed} blocks freed")
    return [o.outputs[0].token_ids for o in outs], stats, log, workers


def check_worker_matches_rank0(worker: dict, stats, log: list) -> None:
    """The worker made exactly rank 0's compactions (and checked each one at run time), counted the same rounds
    and evictions, and forgot every sequence once rank 0 did."""
    assert worker["compactions"] == log
    assert worker["checked"] == len(log)
    s = worker["stage"]
    assert (s["rounds"], s["blocks_freed"], s["tokens_evicted"], s["tokens_seen"]) == (
        stats.compression.rounds, stats.compression.blocks_freed, stats.compression.tokens_evicted,
        stats.compression.tokens_seen)
    assert worker["sequences"] == []


def test_tp2_greedy_equals_tp1_with_kara_compression_over_320_tokens(tiny_dir):
    prompts = random_prompts(0, (7, 19, 12, 26))
    # both query sources in one batch: rounds recompute queries (a sharded forward) or read each rank's cache
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             kv_compression={**KARA, "query_source": source})
              for source in ("recompute", "cache", "recompute", "cache")]
    ref, ref_stats, _, _ = run(tiny_dir, 1, prompts, params)
    got, stats, log, [worker] = run(tiny_dir, 2, prompts, params)

    assert got == ref
    assert all(len(t) == NEW_TOKENS for t in got)
    # compression really ran (many rounds, blocks freed) and changed what the model attended to
    plain, _, _, _ = run(tiny_dir, 1, prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert plain != ref
    assert stats.compression.rounds == ref_stats.compression.rounds >= 10
    assert stats.compression.blocks_freed == ref_stats.compression.blocks_freed > 0
    assert stats.compression.queries_cached == ref_stats.compression.queries_cached > 0
    assert stats.compression.queries_recomputed == ref_stats.compression.queries_recomputed > 0
    # a round whenever the uncompressed tail reaches a window: 24 tokens after the first, which leaves the buffer
    assert len(log) == 4 * ((NEW_TOKENS - 1 - KARA["buffer"]) // (KARA["window"] - KARA["buffer"]))
    check_worker_matches_rank0(worker, stats, log)
    assert worker["heads"] == (2, 1) and worker["num_blocks"] == 256


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_tp2_equals_tp1_under_memory_pressure(tiny_dir, kv_dtype):
    """A pool too small for the batch: compress before preempting (on demand), swap out while the host pool has room,
    then recompute. Rank 0 ships every swap copy; TP=1 and TP=2 take the same decisions (equal block and host-block
    counts) and produce the same tokens. On int8 pages each rank quantizes its own KV heads, whose scales are
    per head, so the shards hold exactly the rows of TP=1's pages, scales included, and move them alike."""
    from paging.kv_cache import bytes_per_block
    from paging.kv_format import kv_format

    prompts = random_prompts(5, (9, 21, 14, 30))
    params = [SamplingParams(temperature=0, max_tokens=140, ignore_eos=True,
                             kv_compression={**KARA, "compression_period": 200 if i % 2 else 24,
                                             "query_source": "cache" if i < 2 else "recompute"}) for i in range(4)]
    # 12 host blocks at TP=1, and at TP=2 too (swap_space is split over the ranks, each block holds half the heads)
    swap = 12 * bytes_per_block(3, 4, 2, 16, kv_format(kv_dtype, torch.float32))
    kw = dict(num_kv_blocks=44, watermark=0, preemption_mode="swap", swap_space=f"{swap}B", kv_cache_dtype=kv_dtype)
    ref, ref_stats, _, _ = run(tiny_dir, 1, prompts, params, **kw)
    got, stats, log, [worker] = run(tiny_dir, 2, prompts, params, **kw)

    assert got == ref
    assert stats.num_preemptions > 0 and stats.swapped_out_blocks > 0 and stats.swapped_in_blocks > 0
    assert stats.recomputed_tokens > 0 and stats.compression.on_demand_rounds > 0
    for name in ("num_preemptions", "swapped_out_blocks", "swapped_in_blocks", "recomputed_tokens"):
        assert getattr(stats, name) == getattr(ref_stats, name), name
    for name in ("rounds", "on_demand_rounds", "blocks_freed"):
        assert getattr(stats.compression, name) == getattr(ref_stats.compression, name), name
    check_worker_matches_rank0(worker, stats, log)


def test_replicated_kv_heads(tmp_path):
    """One KV head at TP=2: both ranks hold it, each with half of its query heads. Query-scored compression is
    rejected (at start-up before any worker starts, and per request); query-free methods run and equal TP=1."""
    make_tiny_hf_model("llama", tmp_path, seed=4, config_overrides={"num_key_value_heads": 1,
                                                                    "max_position_embeddings": 512})
    save_tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 > num_kv_heads=1"):
        build(tmp_path, 2, kv_compression=KARA)
    assert not tp_worker_processes()

    prompts = random_prompts(1, (8, 15))
    small = {"window": 16, "buffer": 4, "compression_period": 12, "ratio": 0.25, "chunk_budget": 2}
    params = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True,
                             kv_compression={"method": method, **small}) for method in ("streaming", "random")]
    ref, _, _, _ = run(tmp_path, 1, prompts, params)
    eng = build(tmp_path, 2)
    try:
        with pytest.raises(InvalidRequestError, match="replicates the KV heads") as err:
            eng.new_request([5, 6, 7], SamplingParams(kv_compression="kara"))
        assert err.value.param == "kv_compression"
        log = record_compactions(eng)
        got = [o.outputs[0].token_ids for o in eng.generate(prompts, params, use_tqdm=False)]
        stats = eng.stats()
        [worker] = eng.core.driver.inspect()
    finally:
        eng.shutdown()
    assert got == ref
    assert stats.compression.rounds > 0 and worker["heads"] == (2, 1)
    check_worker_matches_rank0(worker, stats, log)


def test_settings_are_checked_before_any_worker_starts(tiny_dir):
    from server.cli import build_parser, engine_kwargs_from_args

    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        build(tiny_dir, 0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_q_heads \(4\)"):
        build(tiny_dir, 3)
    assert not tp_worker_processes()
    args = build_parser().parse_args(["serve", str(tiny_dir), "--tensor-parallel-size", "2"])
    assert engine_kwargs_from_args(args)["tensor_parallel_size"] == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tensor-parallel-size", "0"])


def test_settings_without_messages_for_workers_are_rejected_under_tp():
    """Lossless mode (host tier, verification forwards) and sampling-entropy methods (InfoKV: entropies are
    recorded by rank 0's sampler) have no worker messages yet: a TP engine rejects them naming the field, and
    accepts the rest. Checked on the driver's rule alone (no processes)."""
    from types import SimpleNamespace

    from compression import KVCompressionConfig
    from engine.distributed.driver import TPDriver

    drv = SimpleNamespace(size=2, replicated=False, _heads=(2, 4, 1, 2))
    with pytest.raises(ValueError, match="lossless") as err:
        TPDriver.check_compression(drv, KVCompressionConfig("kara", lossless=True))
    assert err.value.param == "kv_compression.lossless"
    with pytest.raises(ValueError, match="entropies") as err:
        TPDriver.check_compression(drv, KVCompressionConfig("infokv"))
    assert err.value.param == "kv_compression.method"
    for method in ("kara", "rkv", "snapkv", "centroid", "keydiff"):
        TPDriver.check_compression(drv, KVCompressionConfig(method))


def test_a_worker_whose_compactions_differ_from_rank0s_stops():
    """The run-time check behind check_worker_matches_rank0: each message carries rank 0's compactions since the
    previous one; a worker that made different ones (another length, other blocks) raises instead of going on."""
    from engine.distributed import protocol as P
    from engine.distributed.parallel_state import NO_TP
    from engine.distributed.worker import RankDivergedError, Worker

    w = Worker(NO_TP, NO_TP, torch.device("cpu"))
    w.pending_checks.extend([(3, 10, [7, 9]), (4, 12, [])])
    with pytest.raises(RankDivergedError, match="compacted"):
        w._apply(P.Sync(compactions=[(3, 10, [7, 8]), (4, 12, [])]))
    w._apply(P.Sync(compactions=[(3, 10, [7, 9]), (4, 12, [])]))
    assert w.checked == 2 and w.pending_checks == []
    with pytest.raises(RankDivergedError, match="compacted"):
        w._apply(P.Sync(compactions=[(5, 4, [])]))  # rank 0 compacted, this rank did not


# ---- the server ---------------------------------------------------------------------------------------------------
def _wait_healthy(proc, base: str, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"server did not start:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


def test_kvllm_serve_tp2_openai_client_and_a_killed_worker(tiny_server_model_dir, tmp_path):
    import openai

    from engine.distributed.parallel_state import free_port
    from server_fixtures import build_engine

    port = free_port()
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", str(tiny_server_model_dir), "--port",
                             str(port), "--tensor-parallel-size", "2", "--dtype", "float32", "--device", "cpu",
                             "--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "256",
                             "--disable-uvicorn-access-log"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                            preexec_fn=die_with_parent)
    worker_pid = None
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, base, log_path)
        worker_pid = int(re.search(r"worker pids (\d+)", log_path.read_text()).group(1))

        messages = [{"role": "user", "content": "Name three colours."}]
        ref_engine = build_engine(tiny_server_model_dir, swap_space=0, lossless_host_memory=0)
        try:
            want = ref_engine.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
            want_text = want[0].outputs[0].text
            prompt_ids = ref_engine.encode_prompt("w1 w2 the quick brown fox")
            want_stream = ref_engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=12,
                                                                        ignore_eos=True), use_tqdm=False)
        finally:
            ref_engine.shutdown()
        client = openai_client(base, timeout=120)
        resp = client.chat.completions.create(model=tiny_server_model_dir.name, messages=messages, temperature=0,
                                              max_tokens=16)
        assert resp.choices[0].message.content == want_text
        assert resp.usage.completion_tokens == len(want[0].outputs[0].token_ids)
        chunks = client.completions.create(model=tiny_server_model_dir.name, prompt=prompt_ids, temperature=0,
                                           max_tokens=12, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want_stream[0].outputs[0].text

        # a long streaming request is running when the worker is killed
        started, outcome = threading.Event(), {}

        def stream_long():
            try:
                s = client.completions.create(model=tiny_server_model_dir.name, prompt="w3 w4 w5", temperature=0,
                                              max_tokens=200, stream=True, extra_body={"ignore_eos": True})
                for _ in s:
                    started.set()
                outcome["result"] = "finished"
            except Exception as err:  # the expected path
                outcome["result"] = err
            finally:
                started.set()

        t = threading.Thread(target=stream_long, daemon=True)
        t.start()
        assert started.wait(60)
        t_kill = time.monotonic()
        os.kill(worker_pid, signal.SIGKILL)
        while httpx.get(base + "/health", timeout=2).status_code != 503:
            assert time.monotonic() - t_kill < 5, "/health still 200 five seconds after a worker died"
            time.sleep(0.05)
        t.join(30)
        assert not t.is_alive(), "the pending request hangs"
        print(f"/health 503 and the pending request failed {time.monotonic() - t_kill:.2f} s after the kill: "
              f"{outcome['result']!r}")
        assert isinstance(outcome["result"], openai.APIError)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=tiny_server_model_dir.name, prompt="w1", max_tokens=2)
        assert err.value.status_code == 503
        assert "died" in log_path.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
    assert proc.returncode is not None


# ---- the real model -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_tp3_engine_equals_tp1(smollm2_engine):
    """Engine(model="smollm2", tensor_parallel_size=3), the user-facing path: rank 0 parses the GGUF once and the
    workers load their shards from its dequantized tensors. SmolLM2 has 9 query and 3 KV heads: one KV head per
    rank. 64 greedy tokens equal TP=1 for a chat prompt and a plain prompt, batched."""
    from engine.engine import Engine

    tok = smollm2_engine.tokenizer
    chat = smollm2_engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompts = [tok(chat, add_special_tokens=False).input_ids, tok("The tallest mountain in the world").input_ids]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in smollm2_engine.generate(prompts, params, use_tqdm=False)]
    t0 = time.perf_counter()
    eng = Engine(model="smollm2", tensor_parallel_size=3, dtype="float32", device="cpu", num_kv_blocks=512,
                 max_model_len=2048)
    try:
        t1 = time.perf_counter()
        got = [o.outputs[0].token_ids for o in eng.generate(prompts, params, use_tqdm=False)]
        t2 = time.perf_counter()
        workers = eng.core.driver.inspect()
    finally:
        eng.shutdown()
    print(f"\nSmolLM2 TP=3: start-up {t1 - t0:.1f} s, 2 x 64 tokens {t2 - t1:.1f} s; "
          f"TP=1 text: {tok.decode(ref[0])!r}")
    assert [w["heads"] for w in workers] == [(3, 1), (3, 1)]
    assert got == ref

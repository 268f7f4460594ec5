"""Models named by Hugging Face Hub id (engine/hub.py), `--tokenizer`, `--revision`, `--download-dir` and
`--trust-remote-code`, all offline: each test lays out its own Hugging Face cache (blobs, snapshot symlinks, refs)
from tiny models written to disk, with HF_HUB_OFFLINE=1 (tests/conftest.py), so nothing here reaches the network.
The references are independent: HF transformers' greedy tokens and the same model loaded from its directory."""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.distributed.parallel_state import free_port
from engine.engine import Engine
from engine.hub import ModelSource, is_hub_id
from engine.sampling_params import SamplingParams
from helpers_models import die_with_parent, lay_out_hub_cache, make_tiny_hf_model, save_tiny_tokenizer
from server_fixtures import openai_client, serve, tiny_server_model_dir  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
REPO = "kvllm-test/tiny-llama"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
PROMPTS = [[5, 17, 99, 3, 64], [40, 41, 42], [7, 8, 9, 10, 11, 12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def _offline():
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE, "these tests must never reach the Hub: run them with HF_HUB_OFFLINE=1"


@contextlib.contextmanager
def engine(model: str, **kwargs):
    """An engine over the tiny model that checks the allocator's invariants after every step and at the end."""
    from conftest import check_every_step

    for key, value in dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64).items():
        kwargs.setdefault(key, value)
    eng = check_every_step(Engine(model=model, **kwargs))
    try:
        yield eng
    finally:
        eng.shutdown()
        eng.check_invariants()
        s = eng.stats()
        assert s.num_free_blocks == s.num_blocks, "KV blocks leaked"


def greedy(eng, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in eng.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """A second tiny Llama (another seed: other weights, other greedy tokens) with the same tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama-seed5")
    make_tiny_hf_model("llama", path, seed=5)
    save_tiny_tokenizer(path)
    return path


def test_hub_id_loads_the_cached_snapshot(tmp_path, tiny_llama_dir, tiny_hf_llama):
    from conftest import hf_greedy

    snapshot = lay_out_hub_cache(tmp_path / "cache", REPO, tiny_llama_dir, COMMIT_A)
    assert (snapshot / "model.safetensors").is_symlink()  # the real cache layout, not a plain copy
    with engine(REPO, download_dir=str(tmp_path / "cache")) as eng:
        assert eng.model_name == REPO  # clients name a Hub model by its id, as with vLLM
        assert Path(eng.model_source.model) == snapshot and eng.model_source.model_dir == snapshot
        by_id = greedy(eng)
    with engine(str(tiny_llama_dir)) as eng:
        assert eng.model_name == tiny_llama_dir.name
        assert greedy(eng) == by_id
    assert by_id == [hf_greedy(tiny_hf_llama, p, GREEDY.max_tokens) for p in PROMPTS]


def test_revision_picks_its_snapshot(tmp_path, tiny_llama_dir, other_model_dir):
    cache = tmp_path / "cache"
    lay_out_hub_cache(cache, REPO, tiny_llama_dir, COMMIT_A)  # refs/main
    lay_out_hub_cache(cache, REPO, other_model_dir, COMMIT_B, ref="v2")
    with engine(str(other_model_dir)) as eng:
        reference_b = greedy(eng)
    with engine(REPO, download_dir=str(cache), revision="v2") as eng:  # a tag
        assert greedy(eng) == reference_b
    with engine(REPO, download_dir=str(cache), revision=COMMIT_B) as eng:  # a commit
        assert greedy(eng) == reference_b
    with engine(REPO, download_dir=str(cache)) as eng:  # main
        assert greedy(eng) != reference_b


def test_unknown_hub_id_offline_is_a_clear_error(tmp_path, tiny_llama_dir):
    cache = tmp_path / "cache"
    lay_out_hub_cache(cache, REPO, tiny_llama_dir, COMMIT_A)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE") as err:
        Engine(model="kvllm-test/not-cached", download_dir=str(cache), device="cpu")
    assert "'kvllm-test/not-cached'" in str(err.value) and str(cache) in str(err.value)
    with pytest.raises(ValueError, match="revision 'nope'"):
        Engine(model=REPO, download_dir=str(cache), revision="nope", device="cpu")
    with pytest.raises(ValueError, match="tokenizer='kvllm-test/no-tokenizer'"):
        Engine(model=REPO, download_dir=str(cache), tokenizer="kvllm-test/no-tokenizer", device="cpu")
    with pytest.raises(ValueError, match="no such path exists"):  # neither a path nor a valid id
        Engine(model=str(tmp_path / "missing" / "model"), device="cpu")


def test_a_snapshot_without_safetensors_is_named(tmp_path, tiny_llama_dir):
    cache = tmp_path / "cache"
    lay_out_hub_cache(cache, REPO, tiny_llama_dir, COMMIT_A, only=(".json",))
    with pytest.raises(ValueError, match=rf"model='{REPO}' \(.*snapshots.*\) is not a model kvllm can load"):
        Engine(model=REPO, download_dir=str(cache), device="cpu")


def test_local_names_never_reach_the_hub(monkeypatch, tiny_llama_dir):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("a local model must not be looked up on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    for name in ("smollm2", str(tiny_llama_dir), str(tiny_llama_dir / "model.safetensors")):
        assert not is_hub_id(name)
        assert ModelSource(name, tokenizer=str(tiny_llama_dir)).resolve() == ModelSource(name, str(tiny_llama_dir))
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("gpt2") and not is_hub_id("a/b/c")


@pytest.mark.parametrize("tokenizer_from", ["path", "hub id"])
def test_tokenizer_replaces_the_models_own(tmp_path, tiny_server_model_dir, tiny_llama_dir, tokenizer_from):
    """The tiny Llama of the server tests ships SmolLM2's BPE tokenizer; `tokenizer` swaps in the word-level one of
    tiny_llama_dir (ids below both vocabularies): text prompts then encode to exactly that tokenizer's ids, and the
    output equals the model run on those ids with its own tokenizer."""
    from transformers import AutoTokenizer

    word_level = AutoTokenizer.from_pretrained(tiny_llama_dir)  # the independent reference
    text = "w5 w9 w11 w40 w77"
    ids = word_level(text).input_ids
    assert ids == [5, 9, 11, 40, 77]
    kwargs = dict(max_model_len=256)
    if tokenizer_from == "path":
        kwargs["tokenizer"] = str(tiny_llama_dir)
    else:
        cache = tmp_path / "cache"
        lay_out_hub_cache(cache, "kvllm-test/word-tokenizer", tiny_llama_dir, COMMIT_A, only=(".json",))
        kwargs.update(tokenizer="kvllm-test/word-tokenizer", download_dir=str(cache))
    with engine(str(tiny_server_model_dir), max_model_len=256) as own:
        assert own.encode_prompt(text) != ids  # SmolLM2's BPE splits it otherwise
        reference = greedy(own, [ids])
    with engine(str(tiny_server_model_dir), **kwargs) as eng:
        assert eng.encode_prompt(text) == ids
        assert greedy(eng, [text]) == reference
        eng.start()
        with serve(eng) as srv:
            resp = openai_client(srv.base_url).completions.create(
                model=eng.model_name, prompt=text, max_tokens=8, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True})
        assert resp.usage.prompt_tokens == len(ids)
        assert resp.choices[0].logprobs.tokens == [word_level.decode([t]) for t in reference[0]]


def test_trust_remote_code_is_accepted_with_one_warning(caplog, tiny_llama_dir):
    with caplog.at_level(logging.WARNING, logger="kvllm"):
        with engine(str(tiny_llama_dir), trust_remote_code=True) as eng:
            assert greedy(eng, PROMPTS[:1])
    warnings = [r.getMessage() for r in caplog.records if "trust_remote_code" in r.getMessage()]
    assert len(warnings) == 1 and "kvllm's own implementation" in warnings[0]
    with pytest.raises(ValueError, match="trust_remote_code must be a boolean"):
        Engine(model=str(tiny_llama_dir), trust_remote_code="yes")


def test_cli_model_source_flags():
    from engine.argspec import given
    from server.cli import build_parser, engine_kwargs_from_args
    from server.config import ServerConfig

    args = build_parser().parse_args(
        ["serve", "Qwen/Qwen3-0.6B", "--tokenizer", "Qwen/Qwen3-8B", "--revision", "v1", "--tokenizer-revision",
         "v2", "--download-dir", "/tmp/hf", "--trust-remote-code", "--generation-config", "vllm", "--max-logprobs",
         "5", "--chat-template", "{{ messages }}"])
    assert args.model == "Qwen/Qwen3-0.6B"
    kw = engine_kwargs_from_args(args)
    assert {k: kw[k] for k in ("tokenizer", "revision", "tokenizer_revision", "download_dir", "trust_remote_code")} \
        == {"tokenizer": "Qwen/Qwen3-8B", "revision": "v1", "tokenizer_revision": "v2", "download_dir": "/tmp/hf",
            "trust_remote_code": True}
    assert given(args, ServerConfig) == {"generation_config": "vllm", "max_logprobs": 5,
                                         "chat_template": "{{ messages }}"}
    plain = engine_kwargs_from_args(build_parser().parse_args(["serve"]))
    assert not {"tokenizer", "revision", "tokenizer_revision", "download_dir", "trust_remote_code"} & set(plain)


def _wait_ready(url: str, proc, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"kvllm serve exited:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"kvllm serve not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def test_kvllm_serve_a_hub_id_offline(tmp_path, tiny_llama_dir):
    """`kvllm serve org/name` with the cache under $HF_HOME (no --download-dir): it serves under the id, generates
    what the directory generates, and applies the snapshot's generation_config.json (temperature 0, at most 5 new
    tokens) to a request that sets neither."""
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=5)
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    lay_out_hub_cache(tmp_path / "hf" / "hub", REPO, model_dir, COMMIT_A)
    with engine(str(tiny_llama_dir)) as eng:
        reference = greedy(eng, PROMPTS[:1])[0][:5]
    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", REPO, "--port", str(port), "--dtype", "float32", "--device",
         "cpu", "--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", "128", "--threads", "1",
         "--disable-uvicorn-access-log"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, preexec_fn=die_with_parent)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [REPO]
        body = {"model": REPO, "prompt": PROMPTS[0], "ignore_eos": True, "logprobs": 0}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 5  # max_new_tokens caps the default 16
        assert out["choices"][0]["finish_reason"] == "length"
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
        assert out["choices"][0]["logprobs"]["tokens"] == [tok.decode([t]) for t in reference]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    text = log.read_text()
    assert "Default sampling parameters have been overridden" in text and "'temperature': 0.0" in text

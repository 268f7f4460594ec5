"""The hostile-request property (bench/request_fuzz.py) over a live server on the tiny model: hypothesis-generated
bodies with extreme numbers, invalid Unicode and arbitrary `kv_compression` objects never get a 5xx, /health stays
200 after every one, and the engine ends idle with every KV block free. `python -m bench.request_fuzz` runs the
same property with 2,000 requests against SmolLM2 (docs/benchmarks.md, soak section)."""
from __future__ import annotations

import os

from bench.request_fuzz import check_server
from server_fixtures import *  # noqa: F401,F403
from server_fixtures import wait_drained

REQUESTS = int(os.environ.get("KVLLM_FUZZ_REQUESTS", "100"))


def test_generated_hostile_requests_never_get_a_5xx_nor_hurt_the_engine(tiny_server, tiny_engine):
    report = check_server(tiny_server.base_url, REQUESTS, seed=1)
    assert report.sent == REQUESTS
    assert not report.bad, report.bad[:5]
    assert report.statuses[200] > 10 and sum(n for s, n in report.statuses.items() if 400 <= s < 500) > 10
    wait_drained(tiny_engine, timeout=120)


STRUCTURED_REQUESTS = int(os.environ.get("KVLLM_FUZZ_STRUCTURED_REQUESTS", "80"))


def test_generated_structured_outputs_tools_and_request_ids_never_get_a_5xx_nor_stall_health(tiny_engine):
    """The structured strategy (schemas, regexes, grammars and choices of every size, the ones that used to freeze
    the server among them; tools, tool calls, request ids) against a server with the reasoning and tool parsers:
    no 5xx, no accepted request failing later, and /health plus a 1-token completion beside the run within 2 s."""
    from server.config import ServerConfig
    from server_fixtures import serve

    config = ServerConfig(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve(tiny_engine, config=config) as srv:
        report = check_server(srv.base_url, STRUCTURED_REQUESTS, seed=2, strategies=("structured",), probe=True)
    assert report.sent == STRUCTURED_REQUESTS
    assert not report.bad and report.failed_accepted == 0, report.bad[:5]
    assert report.statuses[200] > 5 and report.statuses[400] > 5, report.statuses
    assert report.worst_health_s < 2.0 and report.worst_probe_s < 2.0, report
    wait_drained(tiny_engine, timeout=120)


def test_valid_edge_settings_of_every_method_are_served_in_full(tiny_server, tiny_engine):
    """The valid-edge strategy: a valid setting of every method at the edges of its ranges, served in full."""
    report = check_server(tiny_server.base_url, 40, seed=3, strategies=("valid-edge",))
    assert report.sent == 40 and not report.bad and report.failed_accepted == 0, report.bad[:5]
    assert report.statuses == {200: 40}, report.statuses
    wait_drained(tiny_engine, timeout=120)

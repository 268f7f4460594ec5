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

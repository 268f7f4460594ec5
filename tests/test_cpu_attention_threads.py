"""engine/threads.py: the thread count and the OpenMP wait policy set once at process start. Each case runs in a
fresh interpreter, because the policy only counts if it is in the environment when torch (libgomp) loads."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_py(code: str, stderr: list | None = None, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    full.update(env, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)
    assert out.returncode == 0, out.stderr
    if stderr is not None:
        stderr.append(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_before_torch_sets_passive_and_threads_then_all_cores_by_default():
    r = run_py("import json, os, sys; from engine.threads import configure_threads; "
               "assert 'torch' not in sys.modules; s = configure_threads(2); import torch; "
               "n2 = torch.get_num_threads(); d = configure_threads(); "
               "print(json.dumps([s.num_threads, s.wait_policy, os.environ['OMP_WAIT_POLICY'], n2, "
               "d.num_threads, d.wait_policy, len(os.sched_getaffinity(0))]))")
    assert r[:4] == [2, "passive", "PASSIVE", 2]
    assert r[4] == r[6] and r[5] == "passive"  # later calls change the count; the policy stays what torch saw


def test_an_exported_policy_is_kept():
    r = run_py("import json; from engine.threads import configure_threads; s = configure_threads(1); "
               "print(json.dumps(s.wait_policy))", OMP_WAIT_POLICY="ACTIVE")
    assert r == "active"


def test_after_torch_the_policy_cannot_change_and_says_so():
    err = []
    r = run_py("import json, logging, os, torch; logging.basicConfig(level=logging.WARNING); "
               "from engine.threads import configure_threads; s = configure_threads(1); "
               "print(json.dumps([s.wait_policy, os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads()]))",
               stderr=err)
    assert r == [None, None, 1]  # libgomp started with its default; nothing pretends otherwise
    assert "cannot take effect" in err[0]


def test_bad_arguments():
    from engine.threads import configure_threads

    with pytest.raises(ValueError, match="num_threads"):
        configure_threads(-1)
    with pytest.raises(ValueError, match="num_threads"):
        configure_threads(1.5)
    with pytest.raises(ValueError, match="wait_policy"):
        configure_threads(1, wait_policy="spin")

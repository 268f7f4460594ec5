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
    full = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_DISPLAY_ENV")}
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


def libgomp_spin(stderr: str) -> str:
    """The spin count libgomp itself reports at load (OMP_DISPLAY_ENV=VERBOSE prints its settings to stderr)."""
    for line in stderr.splitlines():
        if line.strip().startswith("GOMP_SPINCOUNT ="):
            return line.split("=", 1)[1].strip().strip("'")
    raise AssertionError(f"libgomp printed no GOMP_SPINCOUNT:\n{stderr[-2000:]}")


SPIN_PROBE = ("import json, os; from engine.threads import configure_threads; s = configure_threads(1{extra}); "
              "import torch; torch.ones(64).sum(); "
              "print(json.dumps([s.wait_policy, s.spin_count, os.environ.get('GOMP_SPINCOUNT')]))")


def test_default_is_passive_after_a_short_spin_and_libgomp_gets_it():
    from engine.threads import DEFAULT_SPIN_COUNT

    err = []
    r = run_py(SPIN_PROBE.format(extra=""), stderr=err, OMP_DISPLAY_ENV="VERBOSE")
    assert r == ["passive", DEFAULT_SPIN_COUNT, str(DEFAULT_SPIN_COUNT)]
    assert libgomp_spin(err[0]) == str(DEFAULT_SPIN_COUNT)
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in err[0]


@pytest.mark.parametrize("exported, expect", [
    ({"OMP_WAIT_POLICY": "PASSIVE"}, ["passive", None, None, "0"]),  # the user's pure passive: no spin added
    ({"GOMP_SPINCOUNT": "0"}, [None, 0, "0", "0"]),  # the README's way back to sleeping at once
    ({"GOMP_SPINCOUNT": "20000"}, [None, 20000, "20000", "20000"]),
])
def test_an_exported_policy_or_spin_count_is_the_users_choice(exported, expect):
    err = []
    r = run_py(SPIN_PROBE.format(extra=""), stderr=err, OMP_DISPLAY_ENV="VERBOSE", **exported)
    assert r + [libgomp_spin(err[0])] == expect


@pytest.mark.parametrize("extra, expect", [
    (", spin_count=None", ["passive", None, None, "0"]),
    (", spin_count=40", ["passive", 40, "40", "40"]),
    (", wait_policy='active'", ["active", None, None, "30000000000"]),  # active spins for minutes: no count added
])
def test_spin_count_argument(extra, expect):
    err = []
    r = run_py(SPIN_PROBE.format(extra=extra), stderr=err, OMP_DISPLAY_ENV="VERBOSE")
    assert r + [libgomp_spin(err[0])] == expect


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
    for bad in (-1, 2.5, True, "1500"):
        with pytest.raises(ValueError, match="spin_count"):
            configure_threads(1, spin_count=bad)


def test_kvllm_serve_spins_before_sleeping_and_an_export_still_wins():
    """`kvllm serve` builds its engine on the thread that steps it (one OpenMP pool), so it keeps the engine's short
    spin before sleeping (server/cli.py); an exported GOMP_SPINCOUNT still wins."""
    code = ("import json, os, sys; from server.cli import _early_threads; assert 'torch' not in sys.modules; "
            "_early_threads(['serve', 'm', '--threads', '1']); import torch; torch.ones(64).sum(); "
            "print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), "
            "torch.get_num_threads()]))")
    err = []
    assert run_py(code, stderr=err, OMP_DISPLAY_ENV="VERBOSE") == ["PASSIVE", "1500", 1]
    assert libgomp_spin(err[0]) == "1500"
    err = []
    assert run_py(code, stderr=err, OMP_DISPLAY_ENV="VERBOSE", GOMP_SPINCOUNT="700") == [None, "700", 1]
    assert libgomp_spin(err[0]) == "700"

"""bench/docker_check.sh passes for the CPU image and fails for a broken one: an image that serves nothing, one that
runs as root, one that needs a network at start (each made FROM the checked image with one change).

Opt-in, and skipped by CI's `make test`: it runs only with KVLLM_DOCKER_TESTS=1 and a docker daemon that answers
(minutes per case). The image is KVLLM_DOCKER_IMAGE (default kvllm-check:cpu, which `bash bench/docker_check.sh
--keep` leaves behind); when it is absent the script builds it first (~15 min on 2 cores).

    KVLLM_DOCKER_TESTS=1 .venv/bin/python -m pytest tests/test_docker_image.py -n 0 -v
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "docker_check.sh"
IMAGE = os.environ.get("KVLLM_DOCKER_IMAGE", "kvllm-check:cpu")


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


pytestmark = [
    pytest.mark.skipif(os.environ.get("KVLLM_DOCKER_TESTS") != "1",
                       reason="Docker image checks are opt-in: set KVLLM_DOCKER_TESTS=1"),
    pytest.mark.skipif(os.environ.get("KVLLM_DOCKER_TESTS") == "1" and not _docker_answers(),
                       reason="no docker daemon answers (start dockerd, or run bench/docker_check.sh)"),
]


def check(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, **env})


def summary(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("docker_check: ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def image() -> str:
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        proc = check("--keep")  # builds kvllm-check:cpu and checks it end to end
        assert proc.returncode == 0 and summary(proc).startswith("docker_check: PASS"), summary(proc)
        assert IMAGE == "kvllm-check:cpu", f"the script builds kvllm-check:cpu, not {IMAGE}"
    return IMAGE


@pytest.fixture
def variant(image):
    """Builds `FROM image` plus the given Dockerfile lines as kvllm-check-bad:<name>; removed afterwards."""
    made = []

    def build(name: str, lines: str) -> str:
        tag = f"kvllm-check-bad:{name}"
        subprocess.run(["docker", "build", "-q", "-t", tag, "-"], input=f"FROM {image}\n{lines}\n", text=True,
                       check=True, capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "0"})
        made.append(tag)
        return tag

    yield build
    if made:
        subprocess.run(["docker", "rmi", "-f", *made], capture_output=True)


def test_the_image_passes(image):
    proc = check("--image", image, "--no-native")
    assert proc.returncode == 0, summary(proc)
    assert summary(proc).startswith("docker_check: PASS")


def test_an_image_that_serves_nothing_fails(variant):
    tag = variant("serves-nothing", 'ENTRYPOINT ["sleep", "infinity"]')
    proc = check("--image", tag, "--no-native", HEALTH_TIMEOUT="30")
    assert proc.returncode == 1
    assert "served nothing" in summary(proc)


def test_an_image_that_runs_as_root_fails(variant):
    tag = variant("root", "USER root")
    proc = check("--image", tag, "--no-native")
    assert proc.returncode == 1
    assert "runs as root" in summary(proc)


def test_an_image_that_needs_a_network_at_start_fails(variant):
    """Fetches a page before serving, as a model download at start would: fine with a network (the first run of the
    script passes), fatal in the --network none run."""
    fetch = "import urllib.request; urllib.request.urlopen('http://deb.debian.org/debian/', timeout=30)"
    tag = variant("needs-network", f'ENTRYPOINT ["sh", "-c", "python -c \\"{fetch}\\" '
                                   f'&& exec kvllm serve --host 0.0.0.0 --port 8000"]')
    proc = check("--image", tag, "--no-native")
    assert proc.returncode == 1
    assert "kvllm-check-offline exited before serving" in summary(proc)

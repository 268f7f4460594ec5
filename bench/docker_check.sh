#!/usr/bin/env bash
# `docker run` for real: builds the CPU image (Dockerfile, --target cpu), runs it, and checks what a user gets.
#
#   bash bench/docker_check.sh                 # build, check, remove what it made; prints one summary line
#   bash bench/docker_check.sh --keep          # ... but keep the image (kvllm-check:cpu) and its builder stage
#   bash bench/docker_check.sh --image NAME    # check an existing image (built nothing, NAME is not removed)
#   bash bench/docker_check.sh --no-native     # skip the comparison with `make serve`
#
# Steps (each failure ends the script with `docker_check: FAIL (<what>)`):
#   1. dockerd: used if one answers; else started here (docker.io installed from Debian's packages if absent) and
#      stopped again at the end (KEEP_DOCKERD=1 leaves it running).
#   2. base image: python:3.11-slim if it is present or can be pulled; else kvllm-base:bookworm-py3.11, made once
#      with debootstrap (minimal Debian bookworm + python3 + python3-venv, `docker import`) and KEPT as a cache
#      (docker rmi kvllm-base:bookworm-py3.11 removes it). BASE_IMAGE=NAME picks another one.
#   3. torch: the Makefile's pin as a CPU wheel from pip's local sources (find-links) when there is one, copied into
#      docker/local/ (git-ignored, in the build context) for --build-arg TORCH_WHEEL; else the PyTorch CPU index
#      (the Dockerfile's default). The CA bundle pip uses here, if one is configured (a TLS-intercepting proxy's),
#      goes along as PIP_CA_BUNDLE; both are used by the builder stage only and removed from docker/local/ at exit.
#   4. docker build --target cpu (legacy builder, DOCKER_BUILDKIT=0: present with every docker client, and the
#      builder stage gets a tag so that it can be removed); image size; no compiler or make in the image.
#   5. docker run -p 127.0.0.1:PORT:8000 (no arguments: the default model, baked in); /health; every process of
#      the container runs as a non-root user; the C++ kernels load (no compiler in the image: nothing may rebuild);
#      the official openai client (bench/docker_client.py: completion, chat, streamed chat, per-request Kara);
#      docker stop -t 10 returns within 10 s with exit code 0 (graceful shutdown, not a kill).
#   6. docker run --network none: the server starts with no network at all (so nothing is fetched at start) and
#      answers the same greedy completion from inside the container (docker exec).
#   7. `make serve` (the worktree's .venv, same model and defaults) on 127.0.0.1:NATIVE_PORT: the same requests
#      must give the same tokens as the container.
#   8. the cuda stage (the Dockerfile's global ARGs + that stage, built alone: the legacy builder would run the CPU
#      stages first) with the step-2 image standing in for nvidia/cuda: its first RUN (apt packages, the user) must
#      pass; the build is stopped as its second RUN (pip, then the CUDA torch and FlashInfer) starts. Not with --image.
# At exit: containers, the images built here (unless --keep), docker/local/ copies and the native server are removed.
# Idempotent (a second run starts clean; one run at a time, by a lock). Needs root for dockerd and debootstrap.
set -uo pipefail
cd "$(dirname "$0")/.."
export DOCKER_BUILDKIT=0 PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/kvllm_docker_check}
PORT=${PORT:-18080}
NATIVE_PORT=${NATIVE_PORT:-18081}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-400}   # seconds; loading SmolLM2 takes ~80 s on a 2-core machine
STOP_LIMIT=10
BASE_CACHE=kvllm-base:bookworm-py3.11
BUILT=kvllm-check:cpu
BUILDER=kvllm-check:cpu-build
C_NET=kvllm-check-net
C_OFF=kvllm-check-offline
PY=.venv/bin/python
IMAGE="" KEEP=0 NATIVE=1
while [ $# -gt 0 ]; do
    case "$1" in
        --image) IMAGE=$2; shift ;;
        --keep) KEEP=1 ;;
        --no-native) NATIVE=0 ;;
        *) echo "usage: $0 [--image NAME] [--keep] [--no-native]" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$WORK"
exec 9>"$WORK/lock"
flock -n 9 || { echo "docker_check: FAIL (another docker_check.sh is running)"; exit 1; }

START=$SECONDS
STARTED_DOCKERD="" NATIVE_PID="" MADE_IMAGES=() LOCAL_COPIES=() NOTES=()
note() { NOTES+=("$*"); }
log() { echo "[docker_check $((SECONDS - START)) s] $*"; }
fail() {
    echo "docker_check: FAIL ($*) after $((SECONDS - START)) s"
    exit 1
}

cleanup() {
    docker rm -f "$C_NET" "$C_OFF" >/dev/null 2>&1
    if [ -n "$NATIVE_PID" ]; then kill -TERM -- "-$NATIVE_PID" 2>/dev/null; wait "$NATIVE_PID" 2>/dev/null; fi
    if [ "$KEEP" = 0 ] && [ ${#MADE_IMAGES[@]} -gt 0 ]; then
        docker rmi -f "${MADE_IMAGES[@]}" >/dev/null 2>&1
    fi
    # Untagged images the builds left (a builder stage built anew by the second build when the context changed in
    # between, a cut-short cuda build): rmi takes a leaf with its untagged parents and refuses an image with children.
    local id
    for id in $(sed -n 's/^ ---> \([0-9a-f]\{12\}\)$/\1/p' "$WORK/build.log" "$WORK/cuda.log" 2>/dev/null | tac); do
        [ "$(docker image inspect -f '{{len .RepoTags}}' "$id" 2>/dev/null)" = 0 ] && docker rmi "$id" >/dev/null 2>&1
    done
    rm -f "${LOCAL_COPIES[@]}"
    if [ -n "$STARTED_DOCKERD" ] && [ "${KEEP_DOCKERD:-0}" != 1 ]; then
        kill -TERM "$STARTED_DOCKERD" 2>/dev/null
        for _ in $(seq 1 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
    fi
}
trap cleanup EXIT

# ------------------------------------------------------------------------------------------------ 1. dockerd
start_dockerd() {
    docker info >/dev/null 2>&1 && return
    if ! command -v dockerd >/dev/null; then
        log "installing docker.io from Debian's packages"
        { apt-get install -y --no-install-recommends docker.io \
            || { apt-get update && apt-get install -y --no-install-recommends docker.io; }; } \
            >"$WORK/apt.log" 2>&1 || fail "apt-get install docker.io failed: $WORK/apt.log"
    fi
    log "starting dockerd (log: $WORK/dockerd.log)"
    setsid dockerd >"$WORK/dockerd.log" 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    fail "dockerd did not start: $WORK/dockerd.log"
}

# --------------------------------------------------------------------------------------------- 2. base image
BASE_ARGS=() BASE_DESC="" BASE_NAME=""
provide_base() {
    if [ -n "${BASE_IMAGE:-}" ]; then
        docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || docker pull "$BASE_IMAGE" >/dev/null \
            || fail "BASE_IMAGE=$BASE_IMAGE is neither present nor pullable"
        BASE_ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE") BASE_DESC=$BASE_IMAGE BASE_NAME=$BASE_IMAGE
        return
    fi
    if docker image inspect python:3.11-slim >/dev/null 2>&1 \
        || timeout 120 docker pull python:3.11-slim >"$WORK/pull.log" 2>&1; then
        BASE_ARGS=() BASE_DESC=python:3.11-slim BASE_NAME=python:3.11-slim
        return
    fi
    BASE_ARGS=(--build-arg "BASE_IMAGE=$BASE_CACHE") BASE_NAME=$BASE_CACHE
    BASE_DESC="$BASE_CACHE: debootstrap, python:3.11-slim not pullable"
    docker image inspect "$BASE_CACHE" >/dev/null 2>&1 && return
    command -v debootstrap >/dev/null || apt-get install -y --no-install-recommends debootstrap >"$WORK/apt.log" 2>&1 \
        || fail "apt-get install debootstrap failed: $WORK/apt.log"
    log "no registry: debootstrap Debian bookworm (python 3.11, as python:3.11-slim) into $BASE_CACHE (~5 min, once)"
    local root="$WORK/rootfs"
    rm -rf "$root"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" \
        "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$WORK/debootstrap.log" 2>&1 \
        || fail "debootstrap failed: $WORK/debootstrap.log"
    # what python:3.11-slim leaves out too: package caches and lists, docs, man pages, translations
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
    # An imported image has no environment: without PATH, the Dockerfile's ENV PATH="/opt/venv/bin:$PATH" loses /usr/bin.
    tar -C "$root" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$BASE_CACHE" >/dev/null || fail "docker import failed"
    rm -rf "$root"
}

# ------------------------------------------------------------------------------------------ 3. torch, CA bundle
TORCH_ARGS=() TORCH_DESC=""
provide_torch() {
    local pin wheel cert
    pin=$(grep -o 'torch==[0-9][0-9.]*' Makefile | head -n 1)
    rm -f docker/local/torch-*.whl
    if "$PY" -m pip download -q --no-index --no-deps --only-binary=:all: "$pin" -d docker/local >"$WORK/pip.log" 2>&1; then
        wheel=$(cd docker/local && ls torch-*.whl | head -n 1)
        LOCAL_COPIES+=("docker/local/$wheel")
        case "$wheel" in *+cpu-cp311-*) ;; *) fail "the local torch wheel $wheel is not a cp311 CPU build" ;; esac
        TORCH_ARGS=(--build-arg "TORCH_WHEEL=$wheel") TORCH_DESC="local wheel $wheel"
    else
        TORCH_DESC="$pin from the PyTorch CPU index"
    fi
    cert=$("$PY" -m pip config list 2>/dev/null | sed -n "s/^:env:\.cert='\(.*\)'$/\1/p; s/^global\.cert='\(.*\)'$/\1/p" \
        | head -n 1)
    if [ -n "$cert" ] && [ -f "$cert" ]; then
        cp "$cert" docker/local/ca-bundle.crt
        LOCAL_COPIES+=(docker/local/ca-bundle.crt)
        TORCH_ARGS+=(--build-arg PIP_CA_BUNDLE=ca-bundle.crt)
    fi
}

# ------------------------------------------------------------------------------------------------- 4. build
BUILD_S=0
build_image() {
    log "docker build --target cpu (base $BASE_DESC, torch: $TORCH_DESC; log: $WORK/build.log)"
    local t0=$SECONDS
    MADE_IMAGES+=("$BUILDER" "$BUILT")
    { docker build --force-rm --target cpu-build -t "$BUILDER" "${BASE_ARGS[@]}" "${TORCH_ARGS[@]}" . \
        && docker build --force-rm --target cpu -t "$BUILT" "${BASE_ARGS[@]}" "${TORCH_ARGS[@]}" .; } \
        >"$WORK/build.log" 2>&1 || { tail -n 30 "$WORK/build.log"; fail "docker build failed: $WORK/build.log"; }
    BUILD_S=$((SECONDS - t0))
    IMAGE=$BUILT
}

inspect_image() {
    local bytes tools
    bytes=$(docker image inspect -f '{{.Size}}' "$IMAGE") || fail "no image $IMAGE"
    SIZE=$(awk -v b="$bytes" 'BEGIN { printf "%.2f GB", b / 1e9 }')
    tools=$(docker run --rm --network none --entrypoint sh "$IMAGE" -c \
        'for t in cc c++ gcc g++ make; do command -v $t; done; true')
    [ -z "$tools" ] || fail "the runtime image has a build toolchain: $(echo $tools)"
}

# ---------------------------------------------------------------------------------------------- 5. run it
wait_healthy() {  # container, command that exits 0 once /health answers 200
    local c=$1 t0=$SECONDS
    shift
    while [ $((SECONDS - t0)) -lt "$HEALTH_TIMEOUT" ]; do
        [ "$(docker inspect -f '{{.State.Running}}' "$c" 2>/dev/null)" = true ] || {
            docker logs --tail 15 "$c" 2>&1; fail "container $c exited before serving (exit $(docker inspect \
                -f '{{.State.ExitCode}}' "$c" 2>/dev/null))"; }
        "$@" >/dev/null 2>&1 && { HEALTHY_S=$((SECONDS - t0)); return; }
        sleep 2
    done
    docker logs --tail 15 "$c" 2>&1
    fail "container $c served nothing: /health did not answer within $HEALTH_TIMEOUT s"
}

check_not_root() {
    local uids
    uids=$(docker top "$1" -eo uid,pid,args | awk 'NR > 1 { print $1 }' | sort -u | tr '\n' ' ')
    [ -n "$uids" ] || fail "docker top shows no process in $1"
    case " $uids" in *" 0 "*) docker top "$1" -eo uid,pid,args; fail "a process in the container runs as root" ;; esac
    UIDS=${uids% }
}

run_container() {
    log "docker run -p 127.0.0.1:$PORT:8000 $IMAGE"
    docker run -d --name "$C_NET" -p "127.0.0.1:$PORT:8000" "$IMAGE" >/dev/null || fail "docker run failed"
    wait_healthy "$C_NET" curl -sf "http://127.0.0.1:$PORT/health"
    NET_HEALTHY_S=$HEALTHY_S
    check_not_root "$C_NET"
    docker exec "$C_NET" python -c "from engine.attention import cpu_ext; cpu_ext.load()" >"$WORK/kernels.log" 2>&1 \
        || { tail -n 5 "$WORK/kernels.log"; fail "the C++ kernels do not load in the container (as its user)"; }
    if docker logs "$C_NET" 2>&1 | grep -q "kernel unavailable"; then fail "the server fell back to torch attention"; fi
    log "openai client against the container"
    "$PY" -m bench.docker_client --base-url "http://127.0.0.1:$PORT" --out "$WORK/docker.json" \
        || fail "openai client against the container: $WORK/docker.json"
    local t0 t1 code
    t0=$(date +%s.%N)
    docker stop -t "$STOP_LIMIT" "$C_NET" >/dev/null
    t1=$(date +%s.%N)
    STOP_S=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    code=$(docker inspect -f '{{.State.ExitCode}}' "$C_NET")
    [ "$code" = 0 ] || { docker logs --tail 10 "$C_NET" 2>&1; fail "docker stop: exit code $code (not a graceful shutdown)"; }
    awk -v s="$STOP_S" -v l="$STOP_LIMIT" 'BEGIN { exit !(s < l) }' || fail "docker stop took $STOP_S s"
}

# ------------------------------------------------------------------------------------- 6. no network at start
run_offline() {
    log "docker run --network none $IMAGE"
    docker run -d --name "$C_OFF" --network none "$IMAGE" >/dev/null || fail "docker run --network none failed"
    [ "$(docker inspect -f '{{.HostConfig.NetworkMode}}' "$C_OFF")" = none ] || fail "$C_OFF has a network"
    wait_healthy "$C_OFF" docker exec "$C_OFF" python -c \
        "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5)"
    OFF_HEALTHY_S=$HEALTHY_S
    local want got
    want=$("$PY" -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['completion']['text']))" \
        "$WORK/docker.json")
    got=$(docker exec "$C_OFF" python -c "
import json, urllib.request
body = {'model': 'smollm2', 'prompt': 'The capital of France is', 'max_tokens': 24, 'temperature': 0}
req = urllib.request.Request('http://127.0.0.1:8000/v1/completions', json.dumps(body).encode(),
                             {'Content-Type': 'application/json'})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=300))['choices'][0]['text']))") \
        || fail "completion inside the offline container failed"
    [ "$got" = "$want" ] || fail "offline container answered $got, the networked one $want"
    docker stop -t "$STOP_LIMIT" "$C_OFF" >/dev/null
}

# ------------------------------------------------------------------------------------------ 7. versus make serve
compare_native() {
    make -s install >"$WORK/install.log" 2>&1 || fail "make install failed: $WORK/install.log"  # not in the wait below
    log "make serve on 127.0.0.1:$NATIVE_PORT (log: $WORK/native.log)"
    setsid make -s serve HOST=127.0.0.1 PORT="$NATIVE_PORT" >"$WORK/native.log" 2>&1 &
    NATIVE_PID=$!
    local t0=$SECONDS
    until curl -sf "http://127.0.0.1:$NATIVE_PORT/health" >/dev/null 2>&1; do
        kill -0 "$NATIVE_PID" 2>/dev/null || { tail -n 10 "$WORK/native.log"; fail "make serve exited"; }
        [ $((SECONDS - t0)) -lt "$HEALTH_TIMEOUT" ] || fail "make serve did not become healthy"
        sleep 2
    done
    "$PY" -m bench.docker_client --base-url "http://127.0.0.1:$NATIVE_PORT" --out "$WORK/native.json" \
        || fail "openai client against make serve: $WORK/native.json"
    kill -TERM -- "-$NATIVE_PID" 2>/dev/null
    wait "$NATIVE_PID" 2>/dev/null
    NATIVE_PID=""
    diff -u "$WORK/native.json" "$WORK/docker.json" >"$WORK/native_vs_docker.diff" \
        || { head -n 30 "$WORK/native_vs_docker.diff"; fail "the container's answers differ from make serve's"; }
}

# ------------------------------------------------------------------------------------------- 8. CUDA target
check_cuda_stage() {
    # The legacy builder runs every stage before the target (the CPU ones: minutes of cache checks and copies), so
    # the cuda stage is built alone: the Dockerfile's global ARGs and that stage, verbatim. The whole file is parsed
    # by step 4's build already. Its first RUN (apt packages, the user) and the steps up to the second run, on the
    # step-2 image standing in for nvidia/cuda (Debian bookworm, where that image has Ubuntu 24.04); the build stops
    # as the second RUN starts (pip: it would need this machine's CA, then the CUDA torch and FlashInfer).
    awk '/^FROM / { stage = ($0 ~ /^FROM \$\{CUDA_IMAGE\} AS cuda$/) ? 2 : 1 } stage != 1' Dockerfile \
        >"$WORK/Dockerfile.cuda"
    grep -q '^FROM ${CUDA_IMAGE} AS cuda$' "$WORK/Dockerfile.cuda" || fail "no cuda stage in the Dockerfile"
    log "docker build --target cuda (its stage alone, CUDA_IMAGE=$BASE_NAME) through its first RUN"
    docker build --force-rm -f "$WORK/Dockerfile.cuda" --target cuda --build-arg "CUDA_IMAGE=$BASE_NAME" . \
        >"$WORK/cuda.log" 2>&1 &
    local pid=$! t0=$SECONDS last
    until [ "$(grep -c '^Step [0-9]*/[0-9]* : RUN ' "$WORK/cuda.log")" -ge 2 ]; do
        if ! kill -0 "$pid" 2>/dev/null || [ $((SECONDS - t0)) -gt 900 ]; then
            kill -TERM "$pid" 2>/dev/null
            tail -n 10 "$WORK/cuda.log"
            fail "the cuda stage failed before its second RUN: $WORK/cuda.log"
        fi
        sleep 1
    done
    kill -TERM "$pid" 2>/dev/null  # the client goes, the daemon cancels the build; --force-rm removes its container
    wait "$pid" 2>/dev/null
    # the untagged layers the cut-short build committed (rmi also removes their untagged parents), once the
    # container of the cancelled RUN, which still holds the last of them, is gone
    last=$(sed -n 's/^ ---> \([0-9a-f]\{12\}\)$/\1/p' "$WORK/cuda.log" | tail -n 1)
    [ -n "$last" ] || return 0
    for _ in $(seq 1 30); do
        docker ps -aq --filter "ancestor=$last" | xargs -r docker rm -f >/dev/null 2>&1
        docker rmi "$last" >/dev/null 2>&1 && return 0
        sleep 1
    done
    log "could not remove the cuda stage's layers (docker rmi $last)"
}

summary() {
    echo "docker_check: PASS | image $IMAGE $SIZE (base $BASE_DESC${BUILD_S:+, built in $BUILD_S s}) | no compiler" \
        "in the image | healthy in $NET_HEALTHY_S s, uid $UIDS, C++ kernels loaded | openai client: completion," \
        "chat, stream, Kara (per request) | docker stop ${STOP_S} s, exit 0 | --network none: healthy in" \
        "$OFF_HEALTHY_S s, same completion | $NATIVE_RESULT | $CUDA_RESULT" \
        "| $((SECONDS - START)) s"
}

main() {
    [ -x "$PY" ] || { log "make install (no .venv yet)"; make -s install >"$WORK/install.log" 2>&1 \
        || fail "make install failed: $WORK/install.log"; }
    command -v curl >/dev/null || fail "curl is needed"
    start_dockerd
    docker rm -f "$C_NET" "$C_OFF" >/dev/null 2>&1
    provide_base
    if [ -z "$IMAGE" ]; then
        provide_torch
        build_image
    else
        BUILD_S=""
    fi
    inspect_image
    run_container
    run_offline
    NATIVE_RESULT="make serve: not compared (--no-native)"
    if [ "$NATIVE" = 1 ]; then
        compare_native
        NATIVE_RESULT="same tokens as make serve"
    fi
    CUDA_RESULT="cuda target: not checked (--image: no build cache for the stages before it)"
    if [ -n "$BUILD_S" ]; then
        check_cuda_stage
        CUDA_RESULT="cuda stage: parsed, first RUN passed on $BASE_NAME standing in for nvidia/cuda"
    fi
    summary
}
main

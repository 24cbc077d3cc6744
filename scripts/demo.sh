#!/usr/bin/env bash
# `make demo`: start Parkade on its defaults (`parkade up`: the shipped stories260K model, a local
# broker, the gateway on a free port) in the background, stream one story through Kafka with
# `parkade generate`, ask the gateway's OpenAI API for one more, then stop it.
# Exits non-zero if Parkade did not start, if generate failed, or if Parkade did not stop cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PARKADE="$VENV/bin/parkade"
export PARKADE_HOME="${PARKADE_HOME:-$HOME/.cache/parkade}"
unset KAFKA_BOOTSTRAP_SERVERS  # the embedded broker, whatever this shell points at
START_TIMEOUT_S="${START_TIMEOUT_S:-300}"

# Its banner and lines go to a file, so that they do not land in the middle of the demo's output.
mkdir -p "$PARKADE_HOME"
UP_OUT="$PARKADE_HOME/demo-up.out"
echo "demo: starting Parkade (parkade up: the shipped stories260K model, a local broker); its output: $UP_OUT"
"$PARKADE" up --http-port "${HTTP_PORT:-0}" >"$UP_OUT" 2>&1 &
up_pid=$!
stop_up() {
    if kill -0 "$up_pid" 2>/dev/null; then
        kill -TERM "$up_pid"
    fi
    wait "$up_pid"
}
trap 'stop_up || true; exit 130' INT TERM

# Ready once up.json names this `parkade up` (a stale file of an earlier run does not count).
is_ready() {
    "$VENV/bin/python" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["pid"] != int(sys.argv[2]))' \
        "$PARKADE_HOME/up.json" "$up_pid" 2>/dev/null
}
deadline=$((SECONDS + START_TIMEOUT_S))
until is_ready; do
    if ! kill -0 "$up_pid" 2>/dev/null; then
        wait "$up_pid" || true
        cat "$UP_OUT" >&2
        echo "demo: parkade up exited before it was ready" >&2
        exit 1
    fi
    if ((SECONDS > deadline)); then
        cat "$UP_OUT" >&2
        echo "demo: parkade up not ready after ${START_TIMEOUT_S}s" >&2
        stop_up || true
        exit 1
    fi
    sleep 0.5
done

echo "demo: Parkade is up ($SECONDS s)."
echo
echo '$ parkade generate "Once upon a time" --temperature 0 --max-tokens 64'
status=0
"$PARKADE" generate "Once upon a time" --temperature 0 --max-tokens 64 || status=$?
if ((status == 0)); then
    "$VENV/bin/python" - "$PARKADE_HOME/up.json" <<'PY' || status=$?
import json, sys, urllib.request
url = json.load(open(sys.argv[1]))["gateway_url"] + "/completions"
body = {"prompt": "Lily and Tom", "max_tokens": 32, "temperature": 0}
print(f"\n$ curl {url} -d '{json.dumps(body)}'")
request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=120))
choice, usage = answer["choices"][0], answer["usage"]
print(body["prompt"] + choice["text"])  # the completion goes on from the prompt
print(
    f"[finish_reason={choice['finish_reason']}, prompt_tokens={usage['prompt_tokens']}, "
    f"completion_tokens={usage['completion_tokens']}]"
)
PY
fi
echo
up_status=0
stop_up || up_status=$?
if ((status != 0)); then
    echo "demo: parkade generate failed (exit code $status)" >&2
    exit "$status"
fi
if ((up_status != 0)); then
    cat "$UP_OUT" >&2
    echo "demo: parkade up did not stop cleanly (exit code $up_status)" >&2
    exit "$up_status"
fi
echo "demo: done, and Parkade stopped. To keep it running: $PARKADE up (then, in another shell,"
echo "      $PARKADE generate \"...\", or the OpenAI API at the URL it prints)."

#!/bin/bash
# The serving runs behind issue 13's GPU targets (docs/design.md, "Serving"), on one CUDA GPU, default model.
#
#   bash benchmarks/serving_targets.sh STAGE OUT
#
# Stages, meant to run one after another on one machine (a stage's compile caches serve the next):
#   warm   a short bench-serve over every bucket and policy, so that later servers find their Triton and
#          graph caches warm (a cold start's captures took 306 s on an H200, a warm one 73 s)
#   sweep  bench-serve at 1..64 clients, cost / off / on, 3 passes (about 320 s on an H200)
#   long   1 and 32 clients again with longer levels (24 requests a client), where the 8-a-client levels of
#          the sweep last about a second (about 210 s)
#   load   2000 requests at 32 clients, mixed sampling, 10 % disconnecting: none lost, memory flat
#   one    one client: a --max-batch 1 server benched three times (off, on), then the engine on the same
#          prompts: the server's EAGLE against its own off and against the engine's EAGLE
#   ttft   1 and 32 clients under cost, then off, against one server run by benchmarks/sample_decode_thread.py:
#          the decode thread's samples and its prefill-stream timings per level (OUT/ttft/samples-N.txt), for
#          the TTFT target at 32 clients
# Each stage writes under OUT/<stage>. SPECDEC (default: python3 -m specdec.cli) runs specdec; FRONTENDS
# (default 1) is the servers' HTTP frontend processes (`serve --frontends`).
set -euo pipefail
STAGE=${1:?stage: warm, sweep, long, load, one or ttft}
OUT=${2:?output folder}
SPECDEC=${SPECDEC:-python3 -m specdec.cli}
SERVE=(--model default --drafter eagle --device cuda --task gsm8k-eval --max-tokens 64-128 --frontends "${FRONTENDS:-1}")
mkdir -p "$OUT"

case $STAGE in
warm)
    $SPECDEC bench-serve "${SERVE[@]}" --concurrency 1,2,4,8,16,32,64 --policies cost,off,on --requests 2 \
        --no-warmup --out "$OUT/warm" ;;
sweep)
    $SPECDEC bench-serve "${SERVE[@]}" --concurrency 1,2,4,8,16,32,64 --policies cost,off,on --repeats 3 \
        --out "$OUT/sweep" ;;
long)
    $SPECDEC bench-serve "${SERVE[@]}" --concurrency 1,32 --policies cost,off,on --repeats 3 \
        --requests-per-client 24 --max-batch 64 --out "$OUT/long" ;;
load)
    $SPECDEC bench-serve "${SERVE[@]}" --concurrency 32 --policies cost --requests 2000 --sampling-mix \
        --disconnect-fraction 0.1 --out "$OUT/load" ;;
one)
    PORT=${PORT:-8123}
    $SPECDEC serve --model default --drafter eagle --device cuda --max-batch 1 --context 1024 --port "$PORT" \
        --frontends "${FRONTENDS:-1}" --enable-admin > "$OUT/one-server.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null' EXIT
    for _ in $(seq 300); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
    for r in 1 2 3; do
        $SPECDEC bench-serve --url "http://127.0.0.1:$PORT" --task gsm8k-eval --concurrency 1 --policies off,on \
            --max-tokens 64-128 --requests 80 --out "$OUT/one$r"
    done
    kill $server; wait $server 2>/dev/null || true
    $SPECDEC bench --task gsm8k-eval --limit 10 --max-new-tokens 128 --device cuda --drafters eagle --gammas 5 \
        --peers "" --out "$OUT/engine" ;;
ttft)
    PORT=${PORT:-8124}
    mkdir -p "$OUT/ttft"
    python3 benchmarks/sample_decode_thread.py "$OUT/ttft/samples" serve --model default --drafter eagle --device cuda \
        --max-batch 64 --context 1024 --spec-policy cost --enable-admin --port "$PORT" --frontends "${FRONTENDS:-1}" \
        > "$OUT/ttft/server.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null' EXIT
    for _ in $(seq 600); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
    touch "$OUT/ttft/samples.dump"; sleep 1  # samples-1.txt: the start, before any level
    for policy in cost off; do
        for c in 1 32; do
            $SPECDEC bench-serve --url "http://127.0.0.1:$PORT" --task gsm8k-eval --max-tokens 64-128 --concurrency $c \
                --policies $policy --requests-per-client $([ $c = 1 ] && echo 64 || echo 24) --client-processes 4 \
                --out "$OUT/ttft/$policy-$c"
            touch "$OUT/ttft/samples.dump"; sleep 1
        done
    done
    kill $server; wait $server 2>/dev/null || true ;;
*)
    echo "unknown stage $STAGE: warm, sweep, long, load, one or ttft" >&2; exit 2 ;;
esac

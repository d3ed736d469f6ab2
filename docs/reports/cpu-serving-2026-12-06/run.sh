#!/usr/bin/env bash
# pdserve up (P/D, then --colocated) on the embedded model, 512-token prompts, 32 output tokens, C1 and C16.
set -u
cd "$(dirname "$0")/../../.."
for mode in pd colocated; do
  extra=(); [ $mode = colocated ] && extra=(--colocated)
  python3 -m services.cli up --http-port 8011 --grpc-port 0 "${extra[@]}" > /tmp/cpuserve/up-$mode.log 2>&1 &
  up=$!
  for i in $(seq 1 300); do curl -sf http://127.0.0.1:8011/v1/models >/dev/null && break; sleep 1; done
  python3 -m services.cli bench serve --base-url http://127.0.0.1:8011/v1 --api completions --input-tokens 512 \
    --input-spread 0 --output-tokens 32 --output-spread 0 --ignore-eos --concurrency 1,16 --requests 48 --warmup 4 \
    --no-progress --no-plots --label "pdserve up $mode" --out /tmp/cpuserve/$mode > /tmp/cpuserve/bench-$mode.log 2>&1
  kill -INT $up; wait $up
done

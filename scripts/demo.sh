#!/usr/bin/env bash
# The main job end to end on the embedded defaults (`make demo`): the local store in
# artifacts/ and the cpu backend. Re-running it compiles nothing (the cache hits).
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=${CLI:-.venv/bin/inf2-pipeline}
PY=${PY:-.venv/bin/python}
CONFIG=configs/tiny-llama.yaml
DEST=${DEST:-pulled}
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1. a tiny random-weight Llama checkpoint (8 query / 2 KV heads)"
$CLI tiny-model models/tiny-llama --overwrite

step "2. validate and plan $CONFIG"
$CLI validate "$CONFIG"
$CLI plan "$CONFIG"

step "3. release: compile every bucket on cpu (GQA-padded for tp 4), then publish to artifacts/, signed"
# A local signing key for the demo (CI signs with a KMS key: docs/store.md, "Signed releases").
KEY=artifacts/demo-signing.pem
[ -f "$KEY" ] || $CLI keygen "$KEY"
$CLI release "$CONFIG" --jobs 2 --sign "$KEY" --json > artifacts/.demo-release.json
version=$($PY -c 'import json; print(json.load(open("artifacts/.demo-release.json"))["publish"]["version"])')
echo "released tiny-llama $version"
$CLI promote tiny-llama "$version" --channel demo --store artifacts --trust "${KEY%.pem}.pub.pem"
$CLI list tiny-llama --store artifacts --trust "${KEY%.pem}.pub.pem"

step "4. pull the demo channel into a fresh $DEST/, its signature verified (what the EKS init container does)"
rm -rf "$DEST"
$CLI pull tiny-llama --channel demo --dest "$DEST" --store artifacts --trust "${KEY%.pem}.pub.pem"

step "5. load and generate, beside Hugging Face's greedy tokens"
$CLI run "$DEST/tiny-llama" --prompt-ids 1,17,42,99,5 --max-new-tokens 12 --compare-hf models/tiny-llama

step "6. serve it: OpenAI /v1/completions and /v1/chat/completions on 127.0.0.1, asked by the official client, then stopped"
log=$(mktemp)
$CLI serve "$DEST/tiny-llama" --port 0 --trust "${KEY%.pem}.pub.pem" >"$log" 2>&1 &
server=$!
# The server never outlives the demo, whatever happens below.
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT
trap 'exit 130' INT TERM
$PY scripts/serve_demo.py "$log"
kill -TERM "$server"  # drains in-flight requests, then exits 0
wait "$server"
echo "server stopped"

#!/usr/bin/env bash
# Packaging proof (issue 17): a feeder host installs without torch, and a rank gets what it needs
# from the client extra. In a fresh venv: `pip install .` must not pull torch, and `feeder prep`
# and `feeder serve` run from it while a client from the dev venv (.venv, `make env`) streams;
# the served process must not have torch loaded. Then `pip install '.[client]'` and a
# FeederDataset import, from outside the repository (so nothing comes from the source tree).
# Needs the package index or pip's warm cache (torch is large): not part of `make test`.
#   .ci/fresh-install.sh [VENV_DIR]     (default: a new temporary directory, removed after)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DEV_PY="${DEV_PY:-$REPO/.venv/bin/python}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
WORK="$(mktemp -d)"
VENV="${1:-$WORK/venv}"
SERVER=""
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
cd "$WORK"   # never the repository: imports must come from the venv

step() { echo "== $*"; }

step "fresh venv $VENV: pip install $REPO (no extras)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --progress-bar off "$REPO"
if "$VENV/bin/pip" list 2>/dev/null | grep -iE '^(torch|deepspeed) '; then
  echo "FAIL: the core install pulled torch or deepspeed"; exit 1
fi
echo "pip list: no torch, no deepspeed"
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then echo "FAIL: torch importable"; exit 1; fi

step "feeder prep and feeder serve from it"
"$DEV_PY" -c "
import json
with open('docs.jsonl', 'w') as f:
    for i in range(400):
        f.write(json.dumps({'text': f'document {i} ' + 'lorem ipsum dolor sit amet ' * (i % 17 + 1)}) + '\n')"
"$VENV/bin/feeder" prep docs.jsonl --out data --quiet
"$VENV/bin/feeder" serve --source data --listen 127.0.0.1:0 > serve.log 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q "listening on" serve.log && break; sleep 0.1; done
ADDR="$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' serve.log)"
[ -n "$ADDR" ] || { cat serve.log; echo "FAIL: feeder serve did not start"; exit 1; }
echo "serving on $ADDR (pid $SERVER)"

step "a client from the dev venv streams an epoch from it"
PYTHONPATH="$REPO" "$DEV_PY" -c "
from client import ClientConfig, FeederClient
from feeder.config import StreamSpec
spec = StreamSpec(job='fresh', rank=0, world_size=1, seq_len=32, micro_batch=4, num_epochs=1)
n = sum(b.tokens.numel() for b in FeederClient(ClientConfig(targets=('$ADDR',), spec=spec)))
assert n > 0, n
print(f'streamed {n} tokens')"
if grep -q torch "/proc/$SERVER/maps"; then echo "FAIL: the serving feeder has torch mapped"; exit 1; fi
echo "the serving feeder process has no torch mapped"
kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=""

step "feeder bench without the client: one line, exit 2"
set +e; out="$("$VENV/bin/feeder" bench --quick 2>&1)"; rc=$?; set -e
if [ "$rc" != 2 ] || [ "$(printf '%s\n' "$out" | wc -l)" != 1 ]; then echo "$out"; echo "FAIL: rc $rc"; exit 1; fi
echo "$out"

step "pip install '$REPO[client]': a rank's FeederDataset"
"$VENV/bin/pip" install -q --progress-bar off "$REPO[client]"
"$VENV/bin/python" -c "
import client, torch
from client import FeederDataset
assert client.__file__.startswith('$VENV'), client.__file__
print('FeederDataset from', client.__file__, '; torch', torch.__version__)"
step "ok"

#!/usr/bin/env bash
# Packaging proof (issue 17): a feeder host installs without torch, and a rank gets what it needs
# from the client extra. In a fresh venv: `pip install .` must not pull torch, `feeder prep` and
# `feeder serve` run from it, `feeder bench` says in one line that it needs the client, and the
# packages are installed as feeder, feeder_client, feeder_trainer and feeder_bench (no top-level
# client, trainer or bench). Then, the feeder still serving, `pip install '.[client]'` and a
# FeederClient from that venv streams an epoch from it; the serving process has no torch mapped.
# Everything runs from outside the repository (so nothing comes from the source tree); the
# python (PYTHON) makes the venv and writes the input documents.
# Needs the package index or pip's warm cache (torch is large): not part of `make test`.
#   .ci/fresh-install.sh [VENV_DIR]     (default: a new temporary directory, removed after)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
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
"$PYTHON" -c "
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

step "feeder bench without the client: one line, exit 2"
set +e; out="$("$VENV/bin/feeder" bench --quick 2>&1)"; rc=$?; set -e
if [ "$rc" != 2 ] || [ "$(printf '%s\n' "$out" | wc -l)" != 1 ]; then echo "$out"; echo "FAIL: rc $rc"; exit 1; fi
echo "$out"

step "installed names: feeder, feeder_client, feeder_trainer, feeder_bench; no client, trainer or bench"
"$VENV/bin/python" -c "
import importlib.util, sys
site = [p for p in sys.path if p.endswith('site-packages')][0]
for name in ('feeder', 'feeder_client', 'feeder_trainer', 'feeder_bench'):
    spec = importlib.util.find_spec(name)
    assert spec and spec.origin.startswith(site), (name, spec)
for name in ('client', 'trainer', 'bench'):
    assert importlib.util.find_spec(name) is None, name
print('installed:', site)"

step "pip install '$REPO[client]' while the feeder serves; a rank's FeederClient streams from it"
"$VENV/bin/pip" install -q --progress-bar off "$REPO[client]"
"$VENV/bin/python" -c "
import feeder_client, torch
from feeder_client import ClientConfig, FeederClient, FeederDataset
from feeder.core.config import StreamSpec
assert feeder_client.__file__.startswith('$VENV'), feeder_client.__file__
spec = StreamSpec(job='fresh', rank=0, world_size=1, seq_len=32, micro_batch=4, num_epochs=1)
n = sum(b.tokens.numel() for b in FeederClient(ClientConfig(targets=('$ADDR',), spec=spec)))
assert n > 0, n
print(f'streamed {n} tokens; FeederDataset from', feeder_client.__file__, '; torch', torch.__version__)"
if grep -q torch "/proc/$SERVER/maps"; then echo "FAIL: the serving feeder has torch mapped"; exit 1; fi
echo "the serving feeder process (started before torch was installed) has no torch mapped"
kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=""
step "ok"

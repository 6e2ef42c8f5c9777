#!/usr/bin/env bash
# perf_analyzer concurrency sweeps (streaming, gRPC) against the `ensemble` and `llm` models.
#
#   perf/load/perf_analyzer.sh setup                       # fetch the binary + its two libraries
#   perf/load/perf_analyzer.sh env                         # print PATH / LD_LIBRARY_PATH exports for it
#   perf/load/perf_analyzer.sh sweep --grpc-url 127.0.0.1:8001 [options]
#   perf/load/perf_analyzer.sh run   [options]             # start our server on free ports, sweep, stop
#   perf/load/perf_analyzer.sh version
#
# Where the binary comes from (everything from package registries, cached under
# perf/.cache/perf_analyzer-2.50.0/, git-ignored):
#   * the `perf_analyzer` executable inside the tritonclient==2.50.0 manylinux1 wheel (it needs
#     glibc 2.34 symbols; the newer perf-analyzer wheels need glibc >= 2.38, Debian 12 has 2.36;
#     2.41's binary lacks options genai-perf needs, such as --request-count);
#   * libb64.so.0d from Debian's libb64-0d package (apt-get download + dpkg -x, no install);
#   * libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel (the binary links it even on CPU).
#
# Options (sweep / run):
#   --grpc-url HOST:PORT     server to measure (sweep only)
#   --models "ensemble llm"  models to sweep (default both)
#   --concurrency 1:8:2      perf_analyzer --concurrency-range START:END:STEP (default 1:8:2,
#                            i.e. 1,3,5,7; use e.g. "1:16" with a multiplicative --step below)
#   --levels "1 2 4 8"       explicit concurrency levels (one perf_analyzer call each); wins over
#                            --concurrency
#   --requests N             requests per measurement window (3 windows per level, default 8)
#   --prompt-mean N / --gen-mean N / --num-prompts N / --seed N   input-data workload
#                            (normal lengths, stddev 30% of the mean; defaults 256 / 64 / 64 / 0)
#   --model-dir DIR          checkpoint whose tokenizer sizes the prompts (default: bench model)
#   --out DIR                results folder (default perf/results/2026-11-22-perf-analyzer)
#   --server-args "..."      extra args for `python -m splitfuse.launcher` (run only),
#                            e.g. "--param scheduler_policy=prefill_first"
# Outputs per model and level: CSV (-f), the per-request profile export (JSON with every
# response timestamp) and perf_analyzer's stdout; plus ${OUT}/summary.csv (one row per model x
# level: throughput, latency, time to first token and inter-token latency from the export).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"   # perf/load
PERF="$(cd "$HERE/.." && pwd)"   # the tool folders (.cache) and results stay at perf/'s top
ROOT="$(cd "$PERF/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
PA_VERSION=2.50.0
PA_HOME="${PA_HOME:-$PERF/.cache/perf_analyzer-$PA_VERSION}"
PA_BIN="$PA_HOME/bin/perf_analyzer"
PA_LIB="$PA_HOME/lib"
PIP=("$PY" -m pip)

log() { echo "[perf_analyzer.sh] $*" >&2; }

setup() {
  mkdir -p "$PA_HOME/bin" "$PA_LIB" "$PA_HOME/dl"
  if [[ ! -x "$PA_BIN" ]]; then
    log "downloading tritonclient==$PA_VERSION (manylinux1 wheel) for its perf_analyzer binary"
    "${PIP[@]}" download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
      --python-version 3.11 -d "$PA_HOME/dl" "tritonclient==$PA_VERSION" 2>&1 | grep -v "is ignored" || true
    local whl
    whl="$(ls "$PA_HOME"/dl/tritonclient-$PA_VERSION-*manylinux1_x86_64.whl | head -n1)"
    "$PY" - "$whl" "$PA_BIN" "$PA_VERSION" <<'EOF'
import sys, zipfile, shutil, os
whl, dest, version = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(whl) as z, z.open(f"tritonclient-{version}.data/data/bin/perf_analyzer") as src, \
        open(dest, "wb") as out:
    shutil.copyfileobj(src, out)
os.chmod(dest, 0o755)
EOF
  fi
  if [[ ! -e "$PA_LIB/libb64.so.0d" ]]; then
    if ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d'; then
      log "libb64.so.0d already installed system-wide"
    else
      log "fetching Debian package libb64-0d"
      local deb
      ( cd "$PA_HOME/dl" && apt-get download libb64-0d >/dev/null 2>&1 ) || {
        log "apt-get download failed; trying apt-get update first"
        apt-get update -qq >/dev/null 2>&1 || true
        ( cd "$PA_HOME/dl" && apt-get download libb64-0d )
      }
      deb="$(ls "$PA_HOME"/dl/libb64-0d_*.deb | head -n1)"
      rm -rf "$PA_HOME/dl/b64" && dpkg -x "$deb" "$PA_HOME/dl/b64"
      cp -a "$PA_HOME"/dl/b64/usr/lib/*/libb64.so.0d* "$PA_LIB/"
    fi
  fi
  if [[ ! -e "$PA_LIB/libcudart.so.12" ]]; then
    log "downloading nvidia-cuda-runtime-cu12 for libcudart.so.12"
    "${PIP[@]}" download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
      --python-version 3.11 -d "$PA_HOME/dl" 'nvidia-cuda-runtime-cu12' 2>&1 | grep -v "is ignored" || true
    local whl
    whl="$(ls "$PA_HOME"/dl/nvidia_cuda_runtime_cu12-*.whl | head -n1)"
    "$PY" - "$whl" "$PA_LIB" <<'EOF'
import sys, zipfile, os
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith("nvidia/cuda_runtime/lib/libcudart.so"):
            target = os.path.join(dest, os.path.basename(name))
            with z.open(name) as src, open(target, "wb") as out:
                out.write(src.read())
EOF
  fi
  pa --version >/dev/null || { log "perf_analyzer does not start"; exit 1; }
  log "ready: $PA_BIN ($(pa --version 2>&1 | tail -n1))"
}

pa() { LD_LIBRARY_PATH="$PA_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PA_BIN" "$@"; }

GRPC_URL=""
MODELS="ensemble llm"
CONC="1:8:2"
LEVELS=""
REQUESTS=8
PROMPT_MEAN=256
GEN_MEAN=64
NUM_PROMPTS=64
SEED=0
MODEL_DIR="$PERF/.cache/bench-llama"
OUT="$PERF/results/2026-11-22-perf-analyzer"
SERVER_ARGS=""

parse() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --grpc-url) GRPC_URL="$2"; shift 2;;
      --models) MODELS="$2"; shift 2;;
      --concurrency) CONC="$2"; shift 2;;
      --levels) LEVELS="$2"; shift 2;;
      --requests) REQUESTS="$2"; shift 2;;
      --prompt-mean) PROMPT_MEAN="$2"; shift 2;;
      --gen-mean) GEN_MEAN="$2"; shift 2;;
      --num-prompts) NUM_PROMPTS="$2"; shift 2;;
      --seed) SEED="$2"; shift 2;;
      --model-dir) MODEL_DIR="$2"; shift 2;;
      --out) OUT="$2"; shift 2;;
      --server-args) SERVER_ARGS="$2"; shift 2;;
      *) log "unknown option $1"; exit 2;;
    esac
  done
}

ensure_model() {
  if [[ ! -f "$MODEL_DIR/config.json" ]]; then
    log "building the bench checkpoint in $MODEL_DIR"
    "$PY" -m splitfuse.tools.demo_model "$MODEL_DIR" --arch llama --size bench
  fi
}

sweep() {
  [[ -n "$GRPC_URL" ]] || { log "--grpc-url is required"; exit 2; }
  [[ -x "$PA_BIN" ]] || setup
  ensure_model
  mkdir -p "$OUT"
  local data="$OUT/input_data.json"
  "$PY" "$PERF/served/fastgen_bench.py" pa-input --model-dir "$MODEL_DIR" --out "$data" \
    --prompt-mean "$PROMPT_MEAN" --gen-mean "$GEN_MEAN" --num-requests "$NUM_PROMPTS" --seed "$SEED"
  local levels=()
  if [[ -n "$LEVELS" ]]; then
    read -r -a levels <<<"$LEVELS"
  else
    levels=("range:$CONC")
  fi
  for model in $MODELS; do
    for lvl in "${levels[@]}"; do
      local range tag
      if [[ "$lvl" == range:* ]]; then range="${lvl#range:}"; tag="c${range//:/-}"; else range="$lvl"; tag="c$lvl"; fi
      log "model=$model concurrency=$range requests/level=$REQUESTS"
      # perf_analyzer refuses to overwrite a profile export: a re-run replaces the old level.
      rm -f "$OUT/${model}_${tag}.csv" "$OUT/${model}_${tag}_profile.json"
      # count_windows with a fixed request count keeps each level bounded: perf_analyzer needs
      # 3 windows to call a result stable, and a 999% threshold accepts the first 3 (a streaming
      # LLM load never settles within the default 10%). So each level measures 3 x --requests.
      # perf_analyzer reads the model config, one of the admin APIs the launcher opens only with
      # the admin header (its key from SPLITFUSE_TRITON_ADMIN_KEY; headers go on the command line).
      local admin=()
      [[ -n "${SPLITFUSE_TRITON_ADMIN_KEY:-}" ]] && admin=(-H "triton-grpc-protocol-splitfuse-admin-key:$SPLITFUSE_TRITON_ADMIN_KEY")
      pa -m "$model" -u "$GRPC_URL" -i grpc --streaming "${admin[@]}" \
        --input-data "$data" --concurrency-range "$range" \
        --measurement-mode count_windows --measurement-request-count "$REQUESTS" \
        --max-trials 3 --stability-percentage 999 \
        -f "$OUT/${model}_${tag}.csv" --verbose-csv \
        --profile-export-file "$OUT/${model}_${tag}_profile.json" \
        2>&1 | tee "$OUT/${model}_${tag}.log"
    done
  done
  "$PY" "$PERF/served/fastgen_bench.py" pa-summary --out "$OUT/summary.csv" "$OUT"/*_profile.json
  log "wrote $OUT/summary.csv"
}

run_with_server() {
  ensure_model
  [[ -x "$PA_BIN" ]] || setup
  local ports
  ports="$("$PY" -c 'import socket
s=[socket.socket() for _ in range(3)]
[x.bind(("127.0.0.1",0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))')"
  read -r HTTP GRPC METRICS <<<"$ports"
  local slog="$OUT/server.log"
  mkdir -p "$OUT"
  # The server's admin key (it opens the model config perf_analyzer reads), unless one is given.
  SPLITFUSE_TRITON_ADMIN_KEY="${SPLITFUSE_TRITON_ADMIN_KEY:-$("$PY" -c 'import secrets; print(secrets.token_hex(16))')}"
  export SPLITFUSE_TRITON_ADMIN_KEY
  log "starting splitfuse.launcher (grpc $GRPC) $SERVER_ARGS"
  # shellcheck disable=SC2086
  "$PY" -m splitfuse.launcher --model "$MODEL_DIR" --http-port "$HTTP" --grpc-port "$GRPC" \
    --metrics-port "$METRICS" $SERVER_ARGS >"$slog" 2>&1 &
  local spid=$!
  trap 'kill -TERM '"$spid"' 2>/dev/null; wait '"$spid"' 2>/dev/null || true' EXIT
  local ok=0
  for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$HTTP/v2/health/ready" >/dev/null 2>&1; then ok=1; break; fi
    kill -0 "$spid" 2>/dev/null || break
    sleep 1
  done
  [[ $ok == 1 ]] || { log "server did not become ready; see $slog"; tail -n 30 "$slog" >&2; exit 1; }
  GRPC_URL="127.0.0.1:$GRPC"
  sweep
}

cmd="${1:-}"; shift || true
case "$cmd" in
  setup) setup;;
  env) [[ -x "$PA_BIN" ]] || setup
       echo "export PATH=\"$PA_HOME/bin:\$PATH\" LD_LIBRARY_PATH=\"$PA_LIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\"";;
  version) [[ -x "$PA_BIN" ]] || setup; pa --version;;
  sweep) parse "$@"; sweep;;
  run) parse "$@"; run_with_server;;
  *) sed -n '2,36p' "${BASH_SOURCE[0]}"; exit 2;;
esac

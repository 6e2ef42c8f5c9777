#!/usr/bin/env bash
# genai-perf + the perf_analyzer it drives, in perf/ and git-ignored:
#   * perf/.venv-genai: its own virtual environment with genai-perf==0.0.16 (its pins would
#     fight the main .venv's);
#   * perf/.cache/perf_analyzer-2.50.0: the perf_analyzer binary of the tritonclient==2.50.0
#     manylinux1 wheel and its two libraries (perf/load/perf_analyzer.sh setup; see there why 2.50).
# Idempotent: what is already there is kept.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"   # perf/load
PERF="$(cd "$HERE/.." && pwd)"   # the tool folders stay at perf/'s top
VENV="$PERF/.venv-genai"
PYTHON="${PYTHON_FOR_VENV:-python3}"

"$HERE/perf_analyzer.sh" setup
if [[ ! -x "$VENV/bin/genai-perf" ]]; then
  echo "[setup_genai_perf] creating $VENV with genai-perf==0.0.16" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  "$VENV/bin/pip" install -q 'genai-perf==0.0.16' 2>&1 | grep -v "is ignored" || true
fi
"$VENV/bin/genai-perf" --version
echo "[setup_genai_perf] ready: $VENV/bin/genai-perf with $PERF/.cache/perf_analyzer-2.50.0/bin/perf_analyzer" >&2

#!/usr/bin/env bash
# One GPU run of stage 3's model steps (issue 49 item 5): at most 9 minutes on one H100,
# JSON to $OUT/gpu.json (default ./gpu-out), log to $OUT/log.txt. README.md beside this
# says how to run it and what each field is.
#   bash bench/gpu/run.sh               # on the GPU machine, after bench/gpu/bundle.sh here
#   bash bench/gpu/run.sh --cpu-smoke   # the same code paths, tiny models, on CPU
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
python=python3
if [[ "${1:-}" != --cpu-smoke ]]; then
  # the machine reaches no index: everything comes from the bundle's wheels, into a
  # folder ahead of the image's own packages (its torch stays)
  site="${PAIRFORGE_SITE:-/tmp/pairforge-site}"
  "$python" -m pip install -q --no-index --find-links "$here/bundle/wheels" --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$site" -r "$here/bundle/requirements.txt"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export RAY_DISABLE_DOCKER_CPU_WARNING=1
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# parts that would start after 400 s are skipped; 510 s is the hard stop on a GPU (the
# install above takes under 30 s); the JSON holds every part that finished either way.
# On CPU the stop is 30 minutes: a loaded 2-core host starts Ray's actors slowly.
limit=510
[[ "${1:-}" == --cpu-smoke ]] && limit=1800
set +e
timeout "$limit" "$python" "$here/run.py" --out "$OUT" --budget-s 400 "$@" 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
set -e
echo "run.py exit status $rc; JSON: $OUT/gpu.json"
exit "$rc"

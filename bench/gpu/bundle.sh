#!/usr/bin/env bash
# Build bench/gpu/bundle/: the wheels a lent GPU machine (Python 3.12 with torch) lacks to
# run bench/gpu/run.sh, at this environment's pinned versions (bench/gpu/bundle.py says
# which and why), plus, with --with-source, this checkout's committed source as a tarball
# for a machine that gets no checkout. Prints the bundle's size; at most 64 MiB.
#   bash bench/gpu/bundle.sh [--full] [--with-source] [--python-version 3.12]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$here/bundle"
source=0
args=()
for a in "$@"; do
  if [[ "$a" == --with-source ]]; then source=1; else args+=("$a"); fi
done
mkdir -p "$out"
python "$here/bundle.py" "$out" "${args[@]}"
if [[ $source == 1 ]]; then
  # the code, the bundled sample (the chain's raw shards are made from its scenes) and
  # the helpers bench/ imports from tests/
  git -C "$repo" archive --format=tar.gz -o "$out/pairforge-src.tar.gz" HEAD \
    pyproject.toml pairforge bench tests ':!tests/data'
fi
mib=$(du -sb "$out" | awk '{printf "%.1f", $1 / 1048576}')
echo "bundle: $out, $mib MiB"
awk -v m="$mib" 'BEGIN { exit (m > 64) }' || { echo "over 64 MiB" >&2; exit 1; }

#!/usr/bin/env bash
# open_clip_train reads pairforge's training shards unchanged.
#
#   bash bench/compat.sh [OUT]        (default: out/demo, built first if missing)
#
# open_clip_train's loader needs webdataset<=0.2.86 (it breaks on 1.x), so it runs from
# its own virtual environment, bench/.venv-openclip, made here on first use on top of the
# installed packages (torch, open_clip_torch) with only webdataset downgraded. It trains a
# ViT-B-32 (random init, 64 px) for one epoch on the shards, taking the sample count from
# OUT/shards/sizes.json (no --train-num-samples), and prints its log's last lines.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/demo}
VENV=bench/.venv-openclip
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "webdataset==0.2.86"
fi
[ -f "$OUT/manifest.json" ] || pairforge build examples/demo.yaml -q
last=$(( $(ls "$OUT"/shards/*.tar | wc -l) - 1 ))
shards="$OUT/shards/{00000..$(printf '%05d' "$last")}.tar"
logs=$(mktemp -d)
"$VENV/bin/python" -m open_clip_train.main --train-data "$shards" --dataset-type webdataset \
  --model ViT-B-32 --force-image-size 64 --batch-size 8 --epochs 1 --workers 0 \
  --precision fp32 --logs "$logs" --name compat --save-frequency 0 --log-every-n-steps 1 \
  > "$logs/stdout.txt" 2>&1
grep -E "Train Epoch|num_samples|Start epoch" "$logs/compat/out.log" | cut -d'|' -f3- | tail -8
steps=$(grep -c "Train Epoch" "$logs/compat/out.log")
echo "open_clip_train (webdataset $("$VENV/bin/python" -c 'import webdataset; print(webdataset.__version__)')) trained $steps steps on $shards"

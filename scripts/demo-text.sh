#!/usr/bin/env bash
# The real-text demo, on a fresh machine and with no download: set up; train a 1,024-token BPE on
# the Python standard library's own source (every machine with Python has it) and tokenize it
# into shards (mscale data tokenizer / prepare, into runs/demo-text-data); then train the small
# model of plans/cpu-text.yaml on 8 gloo processes, tp 2 x pp 2 x dp 2, with the held-out loss
# printed before training, every 20 steps and at the end. The run directory is runs/demo-text,
# or $MSCALE_RUN_DIR when set. Extra arguments go to `mscale train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run=${MSCALE_RUN_DIR:-runs/demo-text}
data=runs/demo-text-data  # where plans/cpu-text.yaml reads it
stdlib=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
mscale=.venv/bin/mscale
if [ -f "$data/tokens/manifest.json" ]; then
  echo "demo-text: the corpus is already prepared in $data/tokens (delete it to prepare again)"
else
  echo "demo-text: corpus: the Python standard library's own source, $stdlib/*.py"
  "$mscale" data tokenizer "$stdlib"/*.py --text-ext .py --vocab 1024 -o "$data/tokenizer.json" --force
  "$mscale" data prepare "$stdlib"/*.py --text-ext .py --tokenizer "$data/tokenizer.json" \
    -o "$data/tokens" --workers 2 --force
fi
"$mscale" data inspect "$data/tokens" --stats | tail -n 1
exec "$mscale" train plans/cpu-text.yaml --local 8 --run-dir "$run" "$@"

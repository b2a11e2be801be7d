#!/usr/bin/env bash
# Create .venv and install mscale with its test tools. Idempotent; safe to run on every call: with
# everything installed it says so in one line and returns at once.
# The CPU path pins torch==2.13.0, a CPU build pip finds on local disk: an unpinned `torch`
# would pull a multi-GB CUDA build. On a GPU machine, install your CUDA torch first, then
# `pip install -e .` (the project itself only asks for torch>=2.4).
#
# Every phase says what it installs (and how large, where the wheel is on disk); pip's own output
# goes to a log, and while a step runs a line says what pip is at, every SETUP_TICK_S seconds
# (default 4): redrawn in place on a terminal, a plain line otherwise (CI). A failing step prints
# the end of its log and fails the script with pip's exit code.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
TORCH_PIN="torch==${MSCALE_TORCH:-2.13.0}"
TICK_S=${SETUP_TICK_S:-4}
stamp=.venv/.mscale-installed
want="$TORCH_PIN $(cksum < pyproject.toml | cut -d' ' -f1)"

say() { printf 'setup: %s\n' "$*"; }

# Bytecode for src/ (0.1 s when it is current). Where PYTHONDONTWRITEBYTECODE is set (CI,
# containers) nothing else writes it, and every process, each `--local` worker included, would
# compile mscale's modules from source again: ~0.2 s of CPU per process, measured here.
precompile() { .venv/bin/python -m compileall -q src >/dev/null 2>&1 || true; }

# An empty stamp is the previous form (installed with the default pin; valid unless pyproject.toml
# is newer): take it as it stands rather than run pip again.
if [ -f "$stamp" ] && [ ! -s "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] \
    && [ -z "${MSCALE_TORCH:-}" ]; then
  printf '%s\n' "$want" > "$stamp"
fi

if [ -x .venv/bin/python ] && [ -x .venv/bin/mscale ] && [ -f "$stamp" ] \
    && [ "$(cat "$stamp")" = "$want" ] \
    && compgen -G ".venv/lib/python*/site-packages/torch-${TORCH_PIN#torch==}*.dist-info" >/dev/null; then
  precompile
  say "up to date: .venv has mscale (editable, with test tools) and $TORCH_PIN; nothing to install"
  exit 0
fi

log=$(mktemp "${TMPDIR:-/tmp}/mscale-setup.XXXXXX")
tty=0 cols=80
if [ -t 1 ]; then
  tty=1
  cols=$(tput cols 2>/dev/null || echo 80)
fi
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -f "$log"; exit 130' INT TERM

# What pip is at, from the last line of the log that says ("Collecting rich>=13", "unpacking 46
# package(s) into .venv: a, b, ..."), shortened for one console line.
pip_at() {
  local at n
  at=$(grep -E '^ *(Collecting|Processing|Obtaining|Downloading|Building|Installing collected|Preparing|Successfully installed)' \
    "$log" 2>/dev/null | tail -n 1 | sed -E 's/^ +//; s/ \(from [^)]*\)//' || true)
  case "$at" in
    "Installing collected packages:"*)
      n=$(printf '%s' "${at#*:}" | tr ',' '\n' | grep -c . || true)
      at="unpacking $n package(s) into .venv:${at#*:}" ;;
    "Successfully installed"*) at="finishing" ;;
  esac
  [ ${#at} -gt 70 ] && at="${at:0:67}..."
  printf '%s' "$at"
}

# run LABEL CMD...: run CMD with its output in the log; say what it is at every TICK_S seconds
# while it runs; on failure print the end of the log and exit with CMD's code.
run() {
  local label=$1 start=$SECONDS next=$((SECONDS + TICK_S)) rc=0 at line
  shift
  : > "$log"
  "$@" >> "$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ "$SECONDS" -ge "$next" ] && kill -0 "$pid" 2>/dev/null; then
      next=$((SECONDS + TICK_S))
      at=$(pip_at)
      line="  still $label ($((SECONDS - start)) s)${at:+: $at}"
      if [ "$tty" = 1 ]; then  # one line redrawn in place: never wider than the terminal
        [ ${#line} -ge "$cols" ] && line="${line:0:$((cols - 4))}..."
        printf '\r%s\033[K' "$line"
      else
        printf '%s\n' "$line"
      fi
    fi
  done
  wait "$pid" || rc=$?
  pid=""
  [ "$tty" = 1 ] && printf '\r\033[K'
  if [ "$rc" -ne 0 ]; then
    say "FAILED: $label (exit $rc after $((SECONDS - start)) s); the end of its output:"
    tail -n 25 "$log" | sed 's/^/  | /'
    say "whole output: $log"
    exit "$rc"
  fi
  TOOK=$((SECONDS - start))
}

# "N packages" from pip's "Successfully installed a-1 b-2 ..." line ("nothing new" when none).
installed() {
  local n
  n=$(grep -E '^Successfully installed' "$log" | tail -n 1 | wc -w || true)
  if [ "${n:-0}" -gt 2 ]; then echo "$((n - 2)) package(s) installed"; else echo "nothing new"; fi
}

# Where pip will find the pinned torch wheel: on local disk (pip's find-links), with its size.
torch_wheel() {
  local dirs d f kind ver=${TORCH_PIN#torch==}
  dirs="${PIP_FIND_LINKS:-} $(.venv/bin/pip config list 2>/dev/null | sed -nE "s/.*find-links='(.*)'/\1/p" | tr '\n' ' ')"
  for d in $dirs; do
    d=${d#file://}
    for f in "$d"/torch-"$ver"-*.whl "$d"/torch-"$ver"+*.whl; do
      [ -f "$f" ] || continue
      kind=""
      case "$f" in *+cpu*) kind=" CPU" ;; esac
      printf 'from a %s MB%s wheel on local disk, %s' "$(( $(stat -c %s "$f") / 1000000 ))" \
        "$kind" "$f"
      return 0
    done
  done
  printf 'from the package index'
}

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1) ($PY), pip included"
  run "creating .venv" "$PY" -m venv .venv
  say "created .venv ($TOOK s)"
fi

if .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != sys.argv[1])" \
    "${TORCH_PIN#torch==}" 2>/dev/null; then
  say "$TORCH_PIN: already in .venv"
else
  say "installing $TORCH_PIN $(torch_wheel); unpacking it takes a while"
  run "installing $TORCH_PIN" .venv/bin/pip install --disable-pip-version-check --progress-bar off \
    "$TORCH_PIN"
  say "$TORCH_PIN: $(installed) ($TOOK s)"
fi

say "installing mscale (editable) with its dependencies and test tools (pytest, transformers)"
run "installing mscale's dependencies" .venv/bin/pip install --disable-pip-version-check \
  --progress-bar off -e '.[test]'
say "mscale: $(installed) ($TOOK s); run it as .venv/bin/mscale, or source .venv/bin/activate"
precompile
printf '%s\n' "$want" > "$stamp"
rm -f "$log"

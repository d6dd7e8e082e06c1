#!/usr/bin/env bash
# Time README's two set-up commands as a new user meets them: a fresh clone of
# this repository's HEAD in a temporary directory, pip's cache off, each
# command taken from README.md itself (the first ```bash block, and the one
# after the "test-command" marker), run in its own fresh clone.
#
#   bash scripts/fresh_clone.sh main    # install + `keras-dp train`
#   bash scripts/fresh_clone.sh tests   # install, then .ci/run (the suite, as CI runs it)
#   bash scripts/fresh_clone.sh both
#
# Prints, per command: the install's seconds, the packages it installed and the
# virtual environment's size, then the run's seconds and exit status (for the
# tests, pytest's summary line). The main job runs offline-first as README's
# first command does (KERAS_DP_DATA_DIR unset, so it finds full MNIST only in
# Keras's cache or by download, else trains on the bundled subset), with
# empty caches; the tests
# get ../shared/data as .ci/run gives them. Logs stay in the printed directory.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
what=${1:-both}
case $what in main|tests|both) ;; *) echo "usage: $0 [main|tests|both]" >&2; exit 2 ;; esac
work=$(mktemp -d /tmp/keras_dp_fresh.XXXXXX)
echo "machine: $(uname -m), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "logs: $work"

# The command after the marker, or the first bash block's command.
main_command=$(awk '/^```bash$/ {getline; print; exit}' "$repo/README.md")
test_command=$(awk '/<!-- test-command -->/ {getline; getline; print; exit}' "$repo/README.md")

run() {  # name, command
  local name=$1 command=$2 dir="$work/$1"
  git clone -q "$repo" "$dir/main"
  [ -d "$repo/../shared" ] && ln -s "$(cd "$repo/../shared" && pwd)" "$dir/shared"
  cd "$dir/main"
  # Split "install && run" at the last "&&": the install is everything before it.
  local install=${command% && *} job=${command##* && }
  echo "== $name: $command"
  local start; start=$(date +%s)
  ( export PIP_NO_CACHE_DIR=1; eval "$install" ) > "$dir/install.log" 2>&1
  local installed; installed=$(date +%s)
  local packages size
  packages=$(.venv/bin/python -m pip list 2>/dev/null | tail -n +3 | wc -l)
  size=$(du -sm .venv | cut -f1)
  echo "install: $((installed - start)) s, $packages packages, $size MB"
  local status=0
  if [ "$name" = main ]; then
    # A new user's machine: no MNIST path and empty caches (Keras's datasets
    # and keras_dp's compilation cache live under the clone, not in $HOME).
    ( unset KERAS_DP_DATA_DIR; export KERAS_HOME="$dir/keras" XDG_CACHE_HOME="$dir/cache"
      . .venv/bin/activate && eval "$job" ) > "$dir/run.log" 2>&1 || status=$?
    echo "run: $(( $(date +%s) - installed )) s, exit $status"
    grep -E "^After [0-9]+ epochs" "$dir/run.log" || true
  else
    # As CI runs it: .ci/run (the same README command, under its time limit,
    # with ../shared/data). pytest's summary line carries the suite's own time.
    ( CI=true bash .ci/run ) > "$dir/run.log" 2>&1 || status=$?
    echo "run: $(( $(date +%s) - installed )) s, exit $status (.ci/run, which installs again: a no-op)"
    tail -1 "$dir/run.log"
  fi
  cd "$repo"
  return $status
}

status=0
if [ "$what" != tests ]; then run main "$main_command" || status=$?; fi
if [ "$what" != main ]; then run tests "$test_command" || status=$?; fi
exit $status

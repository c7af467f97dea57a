#!/usr/bin/env bash
# Run the whole test suite. The unit tests (pure: no broker, no Spark) run beside the rest at the
# lowest CPU priority, so they take the time the broker, gpg and Spark tests spend waiting and
# never slow those down; their report follows. Extra arguments go to both pytest runs.
# Exit status: non-zero if either run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
unit_log=$(mktemp -t diode-unit-tests.XXXXXX)
trap 'rm -f "$unit_log"' EXIT
nice -n 19 .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit "$@" >"$unit_log" 2>&1 &
unit=$!
.venv/bin/python -m pytest -q tests/integration tests/scenarios "$@"
rest=$?
wait "$unit"
units=$?
echo "--- tests/unit (run beside the above) ---"
cat "$unit_log"
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5: -k selected nothing in that half
if ! ok "$rest" || ! ok "$units" || { [ "$rest" -eq 5 ] && [ "$units" -eq 5 ]; }; then
  exit 1
fi

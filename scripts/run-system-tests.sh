#!/usr/bin/env bash
# System tier: root, network namespaces, real netfilter, eBPF and the emulated NIC. In CI every test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  if [ "${CI:-}" = "true" ]; then echo "system tests need root in CI" >&2; exit 1; fi
  echo "test-system: SKIPPED, needs root (network namespaces, netfilter); run as root to execute it" >&2
  exit 0
fi
# Three pytest-xdist workers (TEST_WORKERS; make test passes SYSTEM_WORKERS) by module: a module's tests share its
# lab (conftest.lab), so they stay on one worker, in their order; the longest modules go first
# (conftest.LONG_MODULES). Arguments replace the default
# selection (`scripts/run-system-tests.sh -n 0 tests/system/test_deploy.py` runs one module in this process).
if [ $# -eq 0 ]; then set -- tests/system; fi
exec .venv/bin/pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"

#!/usr/bin/env bash
# System tier: root, network namespaces, real netfilter, eBPF and the emulated NIC. In CI every test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  if [ "${CI:-}" = "true" ]; then echo "system tests need root in CI" >&2; exit 1; fi
  echo "test-system: SKIPPED, needs root (network namespaces, netfilter); run as root to execute it" >&2
  exit 0
fi
exec .venv/bin/pytest -q -p no:cacheprovider tests/system "$@"

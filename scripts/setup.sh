#!/usr/bin/env bash
# Idempotent set-up for every make target: Debian packages a tier needs (only when missing) and the pinned .venv.
# Usage: scripts/setup.sh [python|sim|system|browser|all]...   (python is always done)
set -euo pipefail
cd "$(dirname "$0")/.."

APT_SIM="ghdl ghdl-llvm yosys verilator g++ clang make ccache"
APT_SYSTEM="iproute2 iptables nftables clang llvm libbpf-dev bpftool libelf-dev zlib1g-dev libnetfilter-queue-dev
            libmnl-dev gcc-multilib tcpdump ethtool kmod procps ipset conntrack fail2ban ufw ghdl ghdl-llvm yosys verilator g++ make ccache"
APT_BROWSER="chromium chromium-driver"
APT_PYTHON="python3 python3-venv"

want=()
for tier in "$@"; do
  case "$tier" in
    python) ;;
    sim) want+=($APT_SIM) ;;
    system) want+=($APT_SYSTEM) ;;
    browser) want+=($APT_BROWSER) ;;
    all) want+=($APT_SIM $APT_SYSTEM $APT_BROWSER) ;;
    *) echo "setup.sh: unknown tier '$tier'" >&2; exit 2 ;;
  esac
done
# The venv's interpreter: Debian's python3 (APT_PYTHON), not whichever python3 comes first on PATH. A python3 built
# from source without optimisations (a pyenv shim, say) ran the unit tier and every cocotb testbench 1.3-2.4x slower
# on the same machine (docs/testing.md "make test and make test-full"). HF_PYTHON=path picks another one.
PYTHON=${HF_PYTHON:-/usr/bin/python3}
[ -x "$PYTHON" ] && "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || want+=($APT_PYTHON)

missing=()
for pkg in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup.sh: missing Debian packages: ${missing[*]} (run as root, or install them)" >&2
    exit 1
  fi
  echo "setup.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python environment, rebuilt only when the lock file or the interpreter changes (a venv made by another python3 is
# made anew: --clear).
stamp=.venv/.lock-$( (cat requirements.lock pyproject.toml; "$PYTHON" -c 'import sys; print(sys.executable, sys.version)') \
  | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  "$PYTHON" -m venv --clear .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -r requirements.lock
  .venv/bin/pip install -q --no-deps -e .
  rm -f .venv/.lock-*
  touch "$stamp"
fi

# The system tier's eBPF set watcher attaches to syscall tracepoints, whose ids libbpf reads from tracefs; a machine
# booted without it mounted (no systemd mount unit) gets it here.
if [[ " $* " == *" system "* || " $* " == *" all "* ]] && [ "$(id -u)" -eq 0 ] && [ -d /sys/kernel/tracing ] \
   && [ ! -d /sys/kernel/tracing/events ]; then
  mount -t tracefs tracefs /sys/kernel/tracing
fi

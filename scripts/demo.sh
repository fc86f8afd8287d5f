#!/usr/bin/env bash
# `make demo`: the main job end to end on the emulated NIC — lab up, deploy a policy, mixed traffic, counters, verify.
# Leaves the lab and the deployment running so they can be inspected (`hypafilter status`, the dashboard);
# take them down with:  .venv/bin/hypafilter undeploy && .venv/bin/hypafilter lab down
# Usage: scripts/demo.sh [POLICY] [PACKETS]   (default rulesets/example.rules, 2000)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "demo: needs root (network namespaces, netfilter, eBPF)" >&2
  exit 1
fi
HF=.venv/bin/hypafilter
POLICY=${1:-rulesets/example.rules}
PACKETS=${2:-2000}

step() { printf '\n== %s\n' "$*"; }

step "lab up (namespaces hf-send, hf-nic, hf-fw, hf-recv, hf-plain)"
$HF lab up

step "deploy $POLICY on the emulated NIC (the first build of a policy's hardware takes a minute or two)"
$HF deploy "$POLICY"

step "mixed traffic: $PACKETS frames (TCP/UDP/ICMP biased to the policy, some with 'BAD', some malformed) sender -> NIC -> firewall -> receiver"
.venv/bin/python - "$POLICY" "$PACKETS" <<'EOF'
import sys

from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.ops import deploy
from hypafilter.ops.lab import Lab
from hypafilter.ops.verify import collect, drain, make_probes, raw_socket, send

path, n = sys.argv[1], int(sys.argv[2])
policy = parse_policy(open(path).read(), filename=path, base_chain="FORWARD", config=Config())
lab = Lab(deploy.LAB_NAME)
probes = make_probes(policy, n, seed=42, generation=deploy.read_state()["generation"])
tx, rx = raw_socket(lab.ns_send, "hyb0"), raw_socket(lab.ns_recv, "hyb0")
drain(rx)
got = {"recv": {}}
for i in range(0, n, 128):
    send(tx, [p.frame for p in probes[i : i + 128]], pace_every=0)
    collect({"recv": rx}, got, 0.08, 10.0)
collect({"recv": rx}, got, 0.4, 10.0)
print(f"sent {n} frames, {len(got['recv'])} reached the receiver")
EOF

step "counters: hardware (forwarded / dropped / shunted by reason), shim, verdicts in the tool's netfilter chains"
$HF status

step "verify: the same kind of traffic through the hybrid path and through the original policy alone (the kernel as oracle)"
set +e
$HF verify "$POLICY" --packets "$PACKETS"
rc=$?
set -e

step "done (exit $rc). The lab and the deployment stay up; take them down with:"
echo "  $HF undeploy && $HF lab down"
exit $rc

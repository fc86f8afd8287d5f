# hypafilter top-level Makefile: `make demo` runs the main job, `make test` runs every test tier.
# Set-up (Debian packages when missing, the pinned .venv) is part of each target and idempotent.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(VENV)/bin/pytest
BUILD ?= build

.PHONY: all setup test test-full test-quick test-unit test-sim test-system demo lint format synth-estimate bench clean
# pytest-xdist workers of the sim tier (GHDL: one per core) and of the system tier (it waits on the network more than
# it computes: three on the two cores; each test module keeps its own lab; docs/testing.md)
TEST_WORKERS ?= 2
SYSTEM_WORKERS ?= 3

all: test

setup:
	@scripts/setup.sh python

test: lint test-unit test-sim test-system

test-unit:
	@scripts/setup.sh python
	$(PYTEST) -q -n $(TEST_WORKERS) tests/unit

# opt-in: what `make test` runs and what it leaves out to stay within 20 minutes on a 2-core machine (conftest.TEST_FULL:
# the fuzzer's pairs in thirds instead of sixths and its IPv6 policy on the emulated NIC, the 512-bit and 1,100-entry core simulations, post-synthesis simulations of the whole
# core, the emulated NIC's runs of tests that xdp also runs, scale; docs/testing.md "make test and make test-full").
# About 50 minutes on the 2-core machine.
test-full:
	HF_TEST_FULL=1 HF_EMU_V6_FULL=1 $(MAKE) test

test-sim:
	@scripts/setup.sh sim
	$(PYTEST) -q -n $(TEST_WORKERS) --dist load sim

test-system:
	@scripts/setup.sh system browser
	TEST_WORKERS=$(SYSTEM_WORKERS) scripts/run-system-tests.sh

# the edit loop: the unit tier, then one deploy + verify per target (emu, xdp), tests of the system tier run alone;
# docs/testing.md
QUICK_SYSTEM := tests/system/test_deploy.py::test_deploy_status_undeploy \
                tests/system/test_xdp_lab.py::test_verify_rulesets_bridge_mode
test-quick:
	@scripts/setup.sh system
	$(PYTEST) -q tests/unit
	TEST_WORKERS=$(TEST_WORKERS) scripts/run-system-tests.sh $(QUICK_SYSTEM)

demo:
	@scripts/setup.sh system
	scripts/demo.sh

lint:
	@scripts/setup.sh python
	$(VENV)/bin/ruff check mgmt tests sim scripts bench conftest.py
	$(VENV)/bin/ruff format --check mgmt tests sim scripts bench conftest.py

format:
	@scripts/setup.sh python
	$(VENV)/bin/ruff format mgmt tests sim scripts bench conftest.py
	$(VENV)/bin/ruff check --fix mgmt tests sim scripts bench conftest.py

# opt-in: the flow sync service over 250,000 conntrack entries on the emulated NIC and on xdp (deploy, kill -9 of the
# worker, restart; about 3 minutes; `make test` runs the xdp test at 20,000, `make test-full` both). Figures in docs/flowsync.md.
.PHONY: test-ctscale fuzz-optimize fuzz-tree
test-ctscale:
	@scripts/setup.sh system
	HF_TEST_FULL=1 HF_CT_SCALE=250000 scripts/run-system-tests.sh -n 0 -s tests/system/test_flowsync_scale.py \
		tests/system/test_xdp_flowsync_scale.py

# opt-in: sets in the fast path at scale and their lag (docs/sets.md): the blocklist test at 200,000 networks, then the
# ban lag by `ipset add` and by fail2ban beside a 10,000-network blocklist (lab ips; a few minutes)
.PHONY: test-sets-scale
test-sets-scale:
	@scripts/setup.sh system
	HF_SETS_SCALE=200000 scripts/run-system-tests.sh -n 0 -s tests/system/test_ipset_xdp.py -k blocklist
	PYTHONPATH=mgmt $(VENV)/bin/python scripts/set-lag.py --tool ipset --bans 20 --blocklist 10000
	PYTHONPATH=mgmt $(VENV)/bin/python scripts/set-lag.py --tool fail2ban --bans 20 --blocklist 10000

# opt-in: inet6 sets in the xdp program's IPv6 path at scale (a 10,000-network blocklist, 3,000 frames, connections)
# and the lag of an inet6 ban (docs/sets.md "IPv6 sets")
.PHONY: test-sets6
test-sets6:
	@scripts/setup.sh system
	HF_SETS6_SCALE=10000 scripts/run-system-tests.sh -n 0 -s tests/system/test_ipset6_xdp.py -k scale
	HF_LAB=w3b PYTHONPATH=mgmt $(VENV)/bin/python scripts/set-lag.py --family 6 --tool ipset --bans 20 --blocklist 10000

# opt-in: the new-flow permission's withdrawal lag and the FTP race right after a helper rule, 20 runs each (xdp lab
# cth, about a minute; figures in docs/xdp.md "Following the configuration")
.PHONY: newflows-lag
newflows-lag:
	@scripts/setup.sh system
	HF_NEWFLOWS_LAG=20 scripts/run-system-tests.sh -n 0 -s tests/system/test_newflows_follow.py -k "lag or right_after"

# opt-in: the whole core built from acl1_10k (9,544 entries) at 512 and 256 bits; long, see docs/hardware.md
.PHONY: sim-10k
sim-10k:
	@scripts/setup.sh sim
	HF_SIM_10K=1 $(PYTEST) -q -s sim/hypafilter_core/test_hypafilter_core.py -k acl1_10k

synth-estimate:
	@scripts/setup.sh sim
	$(VENV)/bin/hypafilter synth rulesets/example.rules --tool yosys --json

clean:
	rm -rf $(BUILD) sim/*/sim_build .pytest_cache

# opt-in: the XDP fast path against the hardware model on all three 10,000-rule ClassBench sets (one is in make test)
.PHONY: test-xdp-large
test-xdp-large:
	@scripts/setup.sh system
	CI=true HF_XDP_LARGE=1 $(PYTEST) -q -s tests/system/test_xdp.py -k classbench_10k

# opt-in: every (IN, OUT) interface pair of the real rule sets' bridged verify (`make test` runs half of them, in turn
# per policy; docs/testing.md)
.PHONY: test-equivalence-whole
# the whole acl1_1100 set on the emulated NIC with every rule in hardware, corners and trace, alone (make test-full runs
# it too: test_equivalence)
test-equivalence-whole:
	@scripts/setup.sh system
	HF_TEST_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_equivalence.py -k whole_set

.PHONY: test-real-all
test-real-all:
	@scripts/setup.sh system
	CI=true HF_REAL_ALL=1 scripts/run-system-tests.sh tests/system/test_real_rulesets.py

# opt-in: every IPv6 test of the xdp program (docs/ipv6.md "## xdp"): the second policy against ip6tables, the header
# budget and host mode's hop-by-hop, XdpTarget with both table sets, the rollback that keeps the IPv6 interval chains
# (`make test` runs one policy and the lab's verifies)
.PHONY: test-emu-v6
# opt-in: the emulated NIC's dual-stack core through deploy, verify (frames, connections) and update (docs/ipv6.md "## emu"),
# inet6 ipsets in its IPv6 set tables (docs/sets.md "IPv6 sets on the emulated NIC")
test-emu-v6:
	@scripts/setup.sh system
	CI=true HF_TEST_FULL=1 HF_EMU_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_ipv6_deploy.py -k emu
	CI=true HF_TEST_FULL=1 HF_EMU_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_ipv6_alone.py
	CI=true HF_TEST_FULL=1 HF_EMU_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_ipv6_flowcache_emu.py
	CI=true HF_TEST_FULL=1 HF_EMU_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_ipv6_host_connections.py -k emu
	CI=true HF_TEST_FULL=1 HF_EMU_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_ipv6_buffer_emu.py
	CI=true HF_TEST_FULL=1 HF_EMU_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_ipv6_rebuild_emu.py
	CI=true HF_TEST_FULL=1 HF_EMU_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_ipset6_emu.py

# opt-in: bench rate with IPv6 on xdp (-6 --classbench with its trace mapped into IPv6, a dual stack, nft alone, inet6
# ipsets), each frame compared with the kernel (docs/ipv6.md "bench rate with IPv6"; the figures: docs/results.md)
.PHONY: test-bench-v6
test-bench-v6:
	@scripts/setup.sh system
	HF_BENCH_V6=1 scripts/run-system-tests.sh -n 0 tests/system/test_bench_rate_v6.py tests/system/test_bench_rate_nft6.py

.PHONY: test-xdp-v6
test-xdp-v6:
	@scripts/setup.sh system
	CI=true HF_XDP_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_xdp_v6.py tests/system/test_xdp_v6_lab.py \
		tests/system/test_xdp_v6_chains.py
	HF_XDP_V6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_ipv6_alone.py -k xdp

# opt-in: the policy sync service's IPv6 side beyond `make test`'s check: legacy ip6tables tables, a new program
.PHONY: test-livepolicy6
test-livepolicy6:
	@scripts/setup.sh system
	CI=true HF_LIVEPOLICY6_FULL=1 scripts/run-system-tests.sh -n 0 tests/system/test_livepolicy6.py

# opt-in: the kernel-differential fuzzer at 1,000,000 frames (not part of `make test`; figures in docs/deploy.md)
.PHONY: fuzz
fuzz:
	@scripts/setup.sh system
	CI=true HF_TEST_FULL=1 HF_FUZZ_FRAMES=1000000 HF_FUZZ_POLICIES=24 HF_FUZZ_ALL_PAIRS=1 $(PYTEST) -q -s tests/system/test_fuzz.py

# opt-in: strategy tree (docs/optimize.md): its K0 tree alone against each of 100 fuzzer policies alone in the kernel
# (TREE_FUZZ_SEEDS=N), then the fuzzer's deployments on tree's three pairs, emu and xdp (TREE_FUZZ_POLICIES=N, 12)
fuzz-tree:
	@scripts/setup.sh system
	PYTHONPATH=mgmt .venv/bin/python -c "import json, sys; from hypafilter.tools.bench.optimize import fuzz; \
	r = fuzz(range(1, $${TREE_FUZZ_SEEDS:-100} + 1), packets=3000, min_segment=2, k0='tree'); \
	bad = [x for x in r if x['mismatches']]; print(json.dumps(bad)); sys.exit(1 if bad else 0)"
	CI=true HF_TEST_FULL=1 HF_FUZZ_STRATEGY=tree HF_FUZZ_POLICIES=$${TREE_FUZZ_POLICIES:-12} $(PYTEST) -q -s tests/system/test_fuzz.py

# opt-in: strategy tree's live K0 tree on xdp and on the emulated NIC in full (docs/optimize.md "The live K0 tree"):
# verify --live also before the live insert and after the rebuild (`make test` runs the insert and the lazy stage;
# about 20 s on xdp, the emulated NIC's rebuild an emulator build more)
.PHONY: test-live-k0
test-live-k0:
	@scripts/setup.sh system
	HF_LIVE_K0_FULL=1 scripts/run-system-tests.sh -n 0 -s tests/system/test_tree_strategy.py -k live_k0

# opt-in: strategy tree's lazy interval chains at 1,000 rules on xdp (docs/optimize.md "Lazy trees"): inserts and
# deletes by iptables, each follow timed and checked by verify --live (2,000 frames); fails on any mismatch (about 1 min)
.PHONY: test-lazy-trees
test-lazy-trees:
	@scripts/setup.sh system
	PYTHONPATH=mgmt $(VENV)/bin/python scripts/lazy-trees.py --live --complex 1000 --stride 1 --repeats 2 --verify 2000

# opt-in: the fuzzer's dual stack (docs/deploy.md "Fuzzing", IPv6): `hypafilter fuzz -6`, a random ip6tables policy
# beside each IPv4 one and verify's IPv6 frames, on xdp (the program decides IPv6: xdp_ipv6 on) then on the emulated
# NIC (IPv6 to ip6tables with k = 0; the pairs without exact, which builds a core per policy); 4 real connections
# per pair of each family for the policies that read conntrack (even seeds). FUZZ6_POLICIES (12),
# FUZZ6_FRAMES6 (IPv6 frames per pair, 400), FUZZ6_SEED (1), FUZZ6_LAB (lab name prefix, f6z: labs f6zx and f6ze)
.PHONY: fuzz-ipv6
FUZZ6 = HF_LAB=$${FUZZ6_LAB:-f6z}$(1) HF_STATE_DIR=/run/hypafilter/$${FUZZ6_LAB:-f6z}$(1) PYTHONPATH=mgmt .venv/bin/python -m hypafilter
FUZZ6_ARGS = -6 --seed $${FUZZ6_SEED:-1} --policies $${FUZZ6_POLICIES:-12} --frames 200 --frames6 $${FUZZ6_FRAMES6:-400} --connections 4
fuzz-ipv6:
	@scripts/setup.sh system
	$(call FUZZ6,x) fuzz $(FUZZ6_ARGS) --target xdp --pairs quick
	$(call FUZZ6,x) undeploy -q && $(call FUZZ6,x) lab down
	$(call FUZZ6,e) fuzz $(FUZZ6_ARGS) --target emu --pairs selective/interval,index/full,selective/cut,index/interval,selective/tree
	$(call FUZZ6,e) undeploy -q && $(call FUZZ6,e) lab down

# opt-in: `hypafilter optimize` against the kernel on 200 fuzzer policies (docs/optimize.md); OPT_FUZZ_SEEDS=N
fuzz-optimize:
	@scripts/setup.sh system
	PYTHONPATH=mgmt .venv/bin/python -c "import json, sys; from hypafilter.tools.bench.optimize import fuzz; \
	r = fuzz(range(1, $${OPT_FUZZ_SEEDS:-200} + 1), packets=3000); bad = [x for x in r if x['mismatches'] or x['counter_mismatches']]; \
	print(json.dumps(bad)); sys.exit(1 if bad else 0)"

# opt-in: `optimize -6` on acl1, fw1, ipc1 at 1,100 and 5,000 rules mapped into IPv6, each against the kernel with
# IPv6 frames (docs/results.md, "HiTables over IPv6"; about 3 minutes); one JSON per set in $(BENCH_OPT6)
BENCH_OPT6 := $(BUILD)/bench-optimize6
.PHONY: bench-optimize6
bench-optimize6:
	@scripts/setup.sh system
	mkdir -p $(BENCH_OPT6)
	set -e; for s in acl1 fw1 ipc1; do \
	  head -n 5000 $(SHARED)/data/classbench/$${s}_10k.filters > $(BENCH_OPT6)/$${s}_5k.filters; \
	  zcat $(SHARED)/data/classbench/$${s}_10k_trace.gz | awk '$$7 < 5000' | gzip -n > $(BENCH_OPT6)/$${s}_5k_trace.gz; \
	  for set in $(SHARED)/data/classbench/$${s}_1100 $(BENCH_OPT6)/$${s}_5k; do \
	    PYTHONPATH=mgmt $(VENV)/bin/python -m hypafilter bench optimize -6 --classbench $$set.filters \
	      --trace $${set}_trace.gz --json > $(BENCH_OPT6)/$$(basename $$set).json; \
	  done; done

# opt-in: `optimize` and the nft peers (--peers: plain nft, `nft -o`, nft verdict maps) on acl1, fw1, ipc1 at 1,100 and
# 5,000 rules (docs/results.md, "HiTables"; about 10 minutes); one JSON per set in $(BENCH_OPT)
BENCH_OPT := $(BUILD)/bench-optimize
.PHONY: bench-optimize
bench-optimize:
	@scripts/setup.sh system
	mkdir -p $(BENCH_OPT)
	set -e; for s in acl1 fw1 ipc1; do \
	  head -n 5000 $(SHARED)/data/classbench/$${s}_10k.filters > $(BENCH_OPT)/$${s}_5k.filters; \
	  zcat $(SHARED)/data/classbench/$${s}_10k_trace.gz | awk '$$7 < 5000' | gzip -n > $(BENCH_OPT)/$${s}_5k_trace.gz; \
	  for set in $(SHARED)/data/classbench/$${s}_1100 $(BENCH_OPT)/$${s}_5k; do \
	    PYTHONPATH=mgmt $(VENV)/bin/python -m hypafilter bench optimize --peers --classbench $$set.filters \
	      --trace $${set}_trace.gz --json > $(BENCH_OPT)/$$(basename $$set).json; \
	  done; done

# opt-in: XDP target rates (issue: xdp vs iptables vs nft; figures and method in docs/results.md, "XDP target rates").
# acl1_5k = the first 5,000 rules of acl1_10k, its trace = the acl1_10k trace rows whose first matching rule is among
# them (column 7, 0-based); lab name from HF_LAB (default hf).
SHARED ?= ../shared
BENCH_XDP := $(BUILD)/bench-xdp
.PHONY: bench-xdp-rate
bench-xdp-rate:
	@scripts/setup.sh system
	mkdir -p $(BENCH_XDP)
	head -n 5000 $(SHARED)/data/classbench/acl1_10k.filters > $(BENCH_XDP)/acl1_5k.filters
	zcat $(SHARED)/data/classbench/acl1_10k_trace.gz | awk '$$7 < 5000' | gzip -n > $(BENCH_XDP)/acl1_5k_trace.gz
	$(VENV)/bin/hypafilter bench rate --target xdp --classbench $(BENCH_XDP)/acl1_5k.filters --complex 50 --deterministic \
	  --mode selective --actions alternate --trace $(BENCH_XDP)/acl1_5k_trace.gz --json > $(BENCH_XDP)/acl1_5k_c50.json
	$(VENV)/bin/hypafilter bench rate --target xdp --classbench $(BENCH_XDP)/acl1_5k.filters --ct-first --established \
	  --policy DROP --mode selective --trace $(BENCH_XDP)/acl1_5k_trace.gz --json > $(BENCH_XDP)/acl1_5k_ctfirst.json
	$(VENV)/bin/hypafilter bench rate --target xdp --classbench $(BENCH_XDP)/acl1_5k.filters --ct-first --established \
	  --policy DROP --mode selective --trace $(BENCH_XDP)/acl1_5k_trace.gz --prog-repeat 0 --sender live --json \
	  > $(BENCH_XDP)/acl1_5k_ctfirst_live.json
	$(PY) -c 'import json,sys; [print(f, json.dumps({k: json.load(open(f))[k] for k in ("hybrid_pps","iptables_pps","nft_pps","fw_ns","fw_speedup_vs_iptables","fw_speedup_vs_nft","speedup_vs_iptables","speedup_vs_nft","sink_pps","hw_share","mismatches","load")})) for f in sys.argv[1:]]' $(BENCH_XDP)/*.json

# opt-in: the attack mix on xdp (issue #24; docs/results.md "Attack mix"): SYN and UDP floods from 1,000 spoofed
# sources and a 10,000-network blocklist (as an ipset, then as rules) with 20 legitimate connections, at 1,100 and
# 5,000 rules, one run each (~15 min here); lab name from HF_LAB (default hf). ATTACK_SENDERS: the senders, each
# run once per combination (default "packet live": AF_PACKET, then BPF_PROG_TEST_RUN live frames).
BENCH_ATTACK := $(BUILD)/bench-attack
ATTACK_SENDERS ?= packet live
.PHONY: bench-xdp-attack
bench-xdp-attack:
	@scripts/setup.sh system
	mkdir -p $(BENCH_ATTACK)
	head -n 5000 $(SHARED)/data/classbench/acl1_10k.filters > $(BENCH_ATTACK)/acl1_5k.filters
	zcat $(SHARED)/data/classbench/acl1_10k_trace.gz | awk '$$7 < 5000' | gzip -n > $(BENCH_ATTACK)/acl1_5k_trace.gz
	set -e; for set in $(SHARED)/data/classbench/acl1_1100 $(BENCH_ATTACK)/acl1_5k; do for as in ipset rules; do \
	  for a in syn udp; do for s in $(ATTACK_SENDERS); do PYTHONPATH=mgmt $(VENV)/bin/hypafilter bench rate --target xdp \
	    --classbench $$set.filters --ct-first --policy DROP --trace $${set}_trace.gz --prog-repeat 0 --attack $$a \
	    --attackers 1000 --blocklist-as $$as --sender $$s --json > $(BENCH_ATTACK)/$$(basename $$set)_$${a}_$${as}_$$s.json; \
	  done; done; done; done
	$(PY) -c 'import json,sys; [print(f, json.dumps({k: json.load(open(f))[k] for k in ("sender","sender_ns","attack_hw_share","attack","legit_connections_ok","legit","hybrid_pps","iptables_pps","nft_pps","fw_ns","fw_speedup_vs_iptables","fw_speedup_vs_nft","speedup_vs_iptables","speedup_vs_nft","mismatches","load")})) for f in sys.argv[1:]]' $(BENCH_ATTACK)/*.json

# opt-in: each frame sender's own CPU cost per frame on veth (packet: AF_PACKET, xsk: AF_XDP copy mode, live:
# BPF_PROG_TEST_RUN live frames) into an XDP-dropping sink, 1 s x 3 rounds alternated, pinned to the last CPU
# (docs/results.md "Which sender is cheapest on veth"; ~15 s); namespace $(HF_LAB)-snd, HF_LAB default hf.
.PHONY: bench-senders
bench-senders:
	@scripts/setup.sh system
	PYTHONPATH=mgmt $(VENV)/bin/python -m hypafilter.tools.bench.senders

# opt-in: the attack mix on the emulated NIC (issue #24; docs/results.md "Attack mix"): the same SYN and UDP floods
# and 10,000-network blocklist as an ipset at 1,100 rules, three runs each (~2 min here with the core cached; a cold
# Verilator build adds ~2 min); the conntrack membership structure (ct 3) and the set tables decide the attack
# frames in the core. `make bench-emu-attack EMU_BLOCKLIST_AS=rules`: the blocklist as 10,000 rules (a core of
# 11,100 entries: its cold GHDL + Verilator build took 5 min at load 3-13 and 26 min at nice 19 here, a run 3-6
# min; the emulator of that core moved 560-2,900 frames/s, by load; docs/results.md). Lab name from HF_LAB.
BENCH_EMU_ATTACK := $(BUILD)/bench-emu-attack
EMU_BLOCKLIST_AS ?= ipset
.PHONY: bench-emu-attack
bench-emu-attack:
	@scripts/setup.sh system
	mkdir -p $(BENCH_EMU_ATTACK)
	set -e; for r in 1 2 3; do for a in syn udp; do PYTHONPATH=mgmt $(VENV)/bin/hypafilter bench rate --target emu \
	  --classbench $(SHARED)/data/classbench/acl1_1100.filters --ct-first --policy DROP \
	  --trace $(SHARED)/data/classbench/acl1_1100_trace.gz --prog-repeat 0 --attack $$a --attackers 1000 \
	  --blocklist-as $(EMU_BLOCKLIST_AS) --json > $(BENCH_EMU_ATTACK)/acl1_1100_$${a}_$(EMU_BLOCKLIST_AS)_$$r.json; \
	  done; done
	$(PY) -c 'import json,sys; [print(f, json.dumps({k: json.load(open(f))[k] for k in ("attack_hw_share","attack","legit_connections_ok","legit","hybrid_pps","iptables_pps","nft_pps","speedup_vs_iptables","speedup_vs_nft","mismatches","nic","ct_complete_after","load")})) for f in sys.argv[1:]]' $(BENCH_EMU_ATTACK)/*.json

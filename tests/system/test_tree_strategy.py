"""Strategy tree against the kernel (docs/optimize.md, "The hybrid's software side").

1. A 1,100-rule ClassBench policy with 64 complex rules (string matches) ahead of it, deployed on the xdp target
   with strategy tree: every shunted frame's interval chain is those 64 rules, walked as a tree (dispatch gotos, the
   port guard, leaves). verify sends trace-like frames, malformed ones and fragments (which the fast path passes
   unparsed: k = 0, the live K0 tree) through the hybrid and through the policy alone in the plain namespace: 0
   mismatches.
2. The k = 0 path of the program compile writes (not live: K0 walks the whole policy as a tree) loaded alone with
   FORWARD jumping to MAIN, against the policy alone: the same probes (trace headers, rule corners, truncated
   transport headers, first and later fragments, IP options) through both, with iptables-nft and iptables-legacy
   (`hypafilter bench optimize --k0 tree`'s comparison): 0 mismatches.
3. The live K0 tree (docs/optimize.md, "The live K0 tree"): a deployment with strategy tree, a rule inserted by the
   real iptables while deployed (the tree kept, the change diverted ahead of it), then the tree rebuilt; frames that
   take k = 0 at each stage through the hybrid and the live ruleset alone (verify --live): 0 mismatches. And the xdp
   program alone: only trusted unparsed IPv4 frames get the K0 tree's mark value.
4. The same on the emulated NIC (the shim marks the frames its core judged unparsed), and once the policy sync
   service is killed and the core's lease has run out, a rule inserted that K0T does not know: no frame walks K0T,
   verify --live --unfollowed: 0 mismatches. The core is the example's, shared with the other emu modules' builds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from hypafilter import netns

from conftest import ROOT, deployed_lab, need_root, need_tool, ns_sh

pytestmark = pytest.mark.system

LAB = "tre"
TARGET = "xdp"
CB = "acl1_1100"


def _policy_text(shared_dir) -> str:
    from hypafilter.tools.classbench import classbench_policy_text

    text = classbench_policy_text(shared_dir / "data/classbench" / f"{CB}.filters", policy="DROP", actions="alternate")
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    rules = [ln for ln in lines if ln.startswith("-A FORWARD")]
    # 64 complex rules on the headers of every 17th rule (so that frames drawn from the policy reach them)
    cx = [
        f"{r.rsplit(' -j ', 1)[0]} -m string --string BAD{j % 5} --algo bm -j {('DROP', 'ACCEPT')[j % 2]}"
        for j, r in enumerate(rules[::17][:64])
    ]
    return "\n".join(lines[:first] + cx + lines[first:]) + "\n"


def test_a_1100_rule_policy_with_tree_chains_on_xdp_matches_the_kernel(lab, shared_dir):
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.verify import FRAME_KINDS, verify

    policy = parse_policy(_policy_text(shared_dir), filename=f"{CB}+64", base_chain="FORWARD", config=Config())
    assert len(policy.rules) >= 1100
    config = Config(shunt_mode="selective", strategy="tree", target=TARGET)
    report = verify(policy, config, packets=3000, seed=7, malformed=0.3, kinds=FRAME_KINDS)
    listing = ns_sh(lab.ns_fw, "iptables-save", "-c", "-t", "filter")
    gotos = [ln for ln in listing.splitlines() if re.search(r"-A HF\d+_T\d+ .* -g ", ln)]
    assert len(gotos) >= 8, "the interval chain of 64 complex rules is walked as a tree"
    walked = sum(int(ln[1 : ln.index(":")]) for ln in gotos)
    assert walked > 100, "shunted frames went through the tree's dispatch"
    assert "-m u32 ! --u32" in listing  # the port guard: truncated and fragmented frames to the linear copy
    print(f"tree: {report['packets']} frames, {report['mismatches']} mismatches, by kind {report['by_kind']}")
    assert report["mismatches"] == 0, report["examples"][:3]
    unparsed = sum(v["packets"] for k, v in report["by_kind"].items() if k != "valid")
    assert unparsed >= 300 and report["packets"] >= 3000


@pytest.mark.parametrize("backend", ["nft", "legacy"])
def test_the_k0_tree_alone_matches_the_policy_alone(shared_dir, backend):
    need_root()
    need_tool("gcc", "iptables-restore", "iptables-legacy-restore", "ip")
    from hypafilter.tools.bench import optimize as bench
    from hypafilter.tools.classbench import read_trace

    text = _policy_text(shared_dir)
    res, summary = bench.k0_program(text, f"{CB}+64", "tree")
    assert summary["trees"] >= 2 and summary["rules_in_trees"] >= 1100, summary
    rows = bench.trace_rows(read_trace(shared_dir / "data/classbench" / f"{CB}_trace.gz")[:3000])
    rep = bench.run(text, res, rows, repeats=0, probes=2000, backend=backend, log=lambda m: None)
    print(f"k0 tree ({backend}): {rep['probes']} probes, {rep['mismatches']} mismatches")
    assert rep["probes"] > 2000 and rep["mismatches"] == 0, rep


def test_the_k0_tree_of_fuzzer_policies_matches_them():
    """The fuzzer's random policies (user chains with RETURN and goto, MARK read back, conntrack states, strings,
    observing and per-rule-state rules), trees on runs of 2: each policy alone and its K0 tree alone in the kernel,
    the same probes (rule corners, drawn headers, malformed frames, attack shapes). `make fuzz-tree`: 100 policies."""
    need_root()
    need_tool("gcc", "iptables-restore", "ip", "conntrack")
    from hypafilter.tools.bench import optimize as bench

    reps = bench.fuzz((3, 4), packets=2000, min_segment=2, k0="tree", log=print)
    assert all(r["trees"] >= 4 for r in reps), reps
    assert [r["mismatches"] for r in reps] == [0, 0], reps


FULL = bool(os.environ.get("HF_LIVE_K0_FULL"))  # also verify before the change and after the rebuild
BAN = "-s 10.0.1.0/25 -p udp -j DROP"  # inserted before the udp/9999 ACCEPT: verify's frames come from 10.0.1.x
ANCHOR = "-A FORWARD -p udp -m udp --dport 9999 -j ACCEPT"


def _counted(fw: str, pattern: str) -> int:
    """Packets counted by the filter table's rules whose text matches `pattern` (iptables-save -c)."""
    listing = netns.run(["iptables-save", "-c", "-t", "filter"], fw)
    return sum(
        int(m.group(1)) for ln in listing.splitlines() if re.search(pattern, ln) for m in [re.match(r"\[(\d+):", ln)]
    )


def _verify(hf) -> dict:
    p = hf("verify", "--live", "--packets", "600", "--malformed", "0.5", "--seed", "5", "--json", check=False)
    assert p.stdout, p.stderr[-2000:]
    r = json.loads(p.stdout)
    assert r["mismatches"] == 0, r["examples"][:3]
    return r


def test_live_k0_tree_diverts_a_live_insert_until_its_rebuild(lab, tmp_path):
    """The live K0 tree on xdp (docs/optimize.md, "The live K0 tree"; issue #26, Updates): rulesets/example.rules
    deployed with strategy tree (trees on runs of 4), so the xdp program marks the IPv4 frames it passes unparsed
    (fragments, IP options, truncated headers) HF_MARK_K0_TREE and MAIN sends them to K0T, the policy's tree. A rule
    inserted in the operator's chain by the real `iptables -I` while deployed: the policy sync service follows, and
    the new generation's K0T keeps the deployed rules' tree with the new rule's -s/-p ahead of it, sending those
    frames to a linear chain of the live rules that can act there; a deploy of the changed policy rebuilds the tree with the rule in it. At each stage
    `verify --live` (half of its frames malformed) through the hybrid and the live ruleset alone: 0 mismatches, and
    the counters show frames that walked K0T's tree (and its diversion, before the rebuild)."""
    _live_k0(lab, "xdp", tmp_path)


EMU_LAB = "qak0"


@pytest.fixture
def emu_lab():
    """A lab of its own on the emulated NIC (the module's lab is the xdp target's)."""
    with deployed_lab(EMU_LAB, "emu") as lab:
        yield lab


def test_live_k0_tree_on_the_emulated_nic(emu_lab, tmp_path):
    """The same on the emulated NIC: its core shunts a frame it judged unparsed with match_index n and one it did not
    judge (fail safe, an expired lease) with 0xFFFFFF; the shim, with hf_config.control's K0-tree bit (deploy:
    strategy tree, live), marks only the first kind HF_MARK_K0_TREE. The counters of K0T's tree show frames the shim
    marked; `verify --live` through the hybrid and the live ruleset alone: 0 mismatches."""
    _live_k0(emu_lab, "emu", tmp_path)


def _live_k0(lab, target: str, tmp_path) -> None:
    from tests.hfcli import HfCli

    hf = HfCli(lab.name, f"/run/hypafilter/test-{lab.name}")
    fw = lab.ns_fw
    cfg = tmp_path / "tree.toml"
    cfg.write_text(f'strategy = "tree"\ntree_min_segment = 4\ntarget = "{target}"\n')
    text = (ROOT / "rulesets" / "example.rules").read_text()
    hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--config", str(cfg), "-q")
    listing = netns.run(["iptables-save", "-t", "filter"], fw)
    assert re.search(r"-A HF\d+_MAIN -m mark --mark 0x3(/0xffffffff)? -g HF\d+_K0T", listing), listing[:2000]
    if FULL:
        _verify(hf)
        walked = _counted(fw, r"-A HF\d+_K0T -j HF\d+_T\d+")
        print(f"deployed: {walked} frames walked the K0 tree")
        assert walked > 50

    # the live change: the real iptables inserts a rule in the operator's chain, the service follows lazily
    t0 = time.monotonic()
    pos = [ln for ln in text.splitlines() if ln.startswith("-A FORWARD")].index(ANCHOR) + 2  # after the jump
    netns.run(["iptables", "-w", "-I", "FORWARD", str(pos), *BAN.split()], fw)
    hf.followed()
    print(f"followed in {time.monotonic() - t0:.2f} s")
    listing = netns.run(["iptables-save", "-t", "filter"], fw)
    k0t = [ln for ln in listing.splitlines() if re.match(r"-A HF\d+_K0T ", ln)]
    assert any(re.search(r"--src-range 10.0.1.0-10.0.1.127 -g HF\d+_K0D0$", ln) for ln in k0t), k0t  # the change
    assert any(re.search(r"-j HF\d+_T\d+$", ln) for ln in k0t), k0t  # the tree of the deployed rules stays
    r = _verify(hf)
    diverted = _counted(fw, r"-A HF\d+_K0T .*--src-range 10.0.1.0-10.0.1.127 -g HF\d+_K0D0")
    walked = _counted(fw, r"-A HF\d+_K0T -j HF\d+_T\d+")
    print(f"lazy: {diverted} frames diverted to the changed part, {walked} walked the old tree; {r['packets']} frames")
    assert diverted > 0 and walked > 0
    st = hf("status", check=False)
    assert st.returncode == 0, st.stdout  # no drift: the program's (or the shim's) control word is the plan's

    if FULL:  # the rebuild (opt-in: make test-live-k0; the default tier's budget)
        # the changed policy deployed: its tree built with the new rule in it, no diversion left
        lines = text.splitlines()
        lines.insert(lines.index(ANCHOR), f"-A FORWARD {BAN}")
        changed = tmp_path / "changed.rules"
        changed.write_text("\n".join(lines) + "\n")
        hf("deploy", str(changed), "--config", str(cfg), "-q", "--force")
        listing = netns.run(["iptables-save", "-t", "filter"], fw)
        assert "_K0D" not in listing
        _verify(hf)
        walked = _counted(fw, r"-A HF\d+_K0T -j HF\d+_T\d+")
        print(f"rebuilt: {walked} frames walked the new tree")
        assert walked > 50
    if target == "emu":
        _lease_runs_out(hf, fw)
    hf("undeploy", "-q")


def _lease_runs_out(hf, fw: str) -> None:
    """The policy sync service killed, a rule inserted that K0T (the service's) does not know (everything from the
    sender accepted, against the policy's drops); once the core's lease
    has run out it judges nothing and shunts every frame with no index: no frame may walk K0T (its counters stay),
    and `verify --live --unfollowed` with the live ruleset (the new rule in it) alone as oracle: 0 mismatches."""
    from hypafilter.ops import deploy

    st = deploy.read_state(Path(hf.state) / "state.json")
    pids = [int((Path(hf.state) / "policysync.pid").read_text()), hf.service()["worker"]]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    allow = ["-s", "10.0.1.0/24", "-j", "ACCEPT"]
    netns.run(["iptables", "-w", "-I", "FORWARD", "2", *allow], fw)  # after the jump to MAIN
    nic = deploy.target_of(st, deploy.state_config(st))
    deadline = time.monotonic() + st.get("lease_ms", 1000) / 1000 + 3
    while not nic.lease(st["nic"])["expired"]:
        assert time.monotonic() < deadline, "the lease did not run out"
        time.sleep(0.05)
    before = _counted(fw, r"-A HF\d+_K0T ")
    p = hf(
        "verify",
        "--live",
        "--unfollowed",
        "--packets",
        "600",
        "--malformed",
        "0.5",
        "--seed",
        "6",
        "--json",
        check=False,
    )
    assert p.stdout, p.stderr[-2000:]
    r = json.loads(p.stdout)
    walked = _counted(fw, r"-A HF\d+_K0T ") - before
    assert r["mismatches"] == 0, (walked, r["examples"][:3])
    assert r["hw_forwarded"] + r["hw_dropped"] == 0, r  # the core decided nothing
    assert walked == 0, f"{walked} frames walked K0T after the lease ran out"
    netns.run(["iptables", "-w", "-D", "FORWARD", *allow], fw)


H3_LAB = "h3tr"
# 12 complex rules ahead of rulesets/example.rules: every shunted frame's interval chain holds them, long enough for
# a tree with runs of 4 (chains of 8 rules and more); their sources split 10.0.1.0/24, where verify's clients are
CX = [f"-A FORWARD -s 10.0.1.{16 * i}/28 -p udp -m string --string EVIL{i} --algo bm -j DROP" for i in range(12)]
CX_BAN = "-s 10.0.1.0/25 -p udp -m string --string BAD --algo bm -j DROP"  # the operator's change, at position 5
SPARSE_BAN = "-s 10.250.0.0/24 -p udp -m string --string FAR --algo bm -j DROP"  # a source no rule names
SPARSE_BAN2 = "-s 10.251.0.0/24 -p udp -m string --string FAR --algo bm -j DROP"


@pytest.fixture
def h3_lab():
    """A lab of its own on xdp (the module's lab is the other tests')."""
    with deployed_lab(H3_LAB, "xdp") as lab:
        yield lab


def _tree_chains(fw: str) -> tuple[str, list[str]]:
    """(the generation's prefix, the distinct rules of the tree chains T<n> in the kernel, chain names taken out,
    sorted): a follow keeps unchanged chains under an earlier generation's name, and one chain for several of the
    same rules."""
    listing = netns.run(["iptables-save", "-t", "filter"], fw)
    prefix = re.search(r"-j (HF\d+_)MAIN", listing).group(1)
    lines = {re.sub(r"HF\d+_T\d+", "T", ln) for ln in listing.splitlines() if re.match(r"-A HF\d+_T\d+ ", ln)}
    return prefix, sorted(lines)


def _tool_chains(fw: str) -> dict[str, int]:
    """The tool's chains in the kernel and their rules."""
    out: dict[str, int] = {}
    for ln in netns.run(["iptables-save", "-t", "filter"], fw).splitlines():
        if m := re.match(r"(?::|-A )(HF\d+_\S+)", ln):
            out[m.group(1)] = out.get(m.group(1), 0) + ln.startswith("-A ")
    return out


def _follow_loads(hf, fw: str, change: list[str], trees_kept: bool = True) -> tuple[int, int]:
    """The real `iptables` change, then once the service followed: (the rules of the tool's chains the follow
    created, read from the kernel: chains that were not there before; all the tool's rules in the kernel).
    `trees_kept`: no tree chain was loaded again."""
    before = _tool_chains(fw)
    netns.run(["iptables", "-w", *change], fw)
    hf.followed()
    after = _tool_chains(fw)
    created = [c for c in after if c not in before]
    loaded = sum(after[c] for c in created)
    rec = json.loads((Path(hf.state) / "state.json").read_text())["history"][-1]
    assert rec["kind"] == "follow" and rec.get("rules_loaded") == loaded, (rec, loaded)
    if trees_kept:
        assert not [c for c in created if re.fullmatch(r"HF\d+_T\d+", c)], "the follow loaded tree chains again"
    return loaded, sum(after.values())


def test_a_live_interval_chain_tree_is_kept_for_a_small_change(h3_lab, tmp_path):
    """The interval chains' trees rebuilt lazily (docs/optimize.md, "Lazy trees"; issue #26, Updates): example.rules
    with 12 complex rules ahead deployed on xdp with strategy tree (runs of 4), so every leaf walks its chain as a
    tree; the real `iptables -I` adds a complex rule to the operator's chain whose source 8 of the 12 meet (dense).
    The follow loads only the tool's chains whose content changed, no tree chain (the chains new in the kernel hold
    less than half of the tool's rules; main loaded them all: docs/optimize.md, "What a follow loads"), and the
    deployment's history says how many. The kernel's tree chains are the deployed ones rule for rule (iptables-save,
    chain names taken out), the new rule is in none of them, and every leaf first sends the new rule's -s/-p to a
    chain TD<n>. `verify --live` (half of its frames malformed) through the hybrid and the live ruleset alone: 0
    mismatches, with frames counted on the diversion and in the trees. Then `iptables -D` of a deployed complex rule:
    its copies in no tree, its source diverted where a tree is kept (a tree whose two diversions would write more
    rules than it is built anew), verify --live again 0 mismatches. Last a sparse ban (a source no rule names):
    fewer than a third of the tool's rules loaded, verify --live 0 mismatches."""
    from tests.hfcli import HfCli

    hf = HfCli(h3_lab.name, f"/run/hypafilter/test-{h3_lab.name}")
    fw = h3_lab.ns_fw
    cfg = tmp_path / "tree.toml"
    cfg.write_text('strategy = "tree"\ntree_min_segment = 4\ntarget = "xdp"\n')
    lines = (ROOT / "rulesets" / "example.rules").read_text().splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    policy = tmp_path / "cx.rules"
    policy.write_text("\n".join(lines[:first] + CX + lines[first:]) + "\n")
    hf("deploy", str(policy), "--config", str(cfg), "-q")
    gen1, trees1 = _tree_chains(fw)
    assert len(trees1) > 20, trees1

    # a dense change: the ban's source meets 8 of the 12 complex rules ahead of the example's. The follow loads only
    # the chains it changed (the leaves, their diversion, K0T's): the trees and everything else stay under the
    # deployed generation's names (main loaded all the tool's chains anew)
    t0 = time.monotonic()
    loaded, total = _follow_loads(hf, fw, ["-I", "FORWARD", "5", *CX_BAN.split()])  # after the jump to MAIN
    print(f"dense follow in {time.monotonic() - t0:.2f} s: {loaded} of the tool's {total} rules loaded")
    assert 0 < loaded * 2 < total, (loaded, total)
    gen2, trees2 = _tree_chains(fw)
    assert gen2 != gen1
    assert trees2 == trees1, "the follow rewrote the trees"
    # the service's first follow (its process started at the deploy) took the trees from the deployment's tree cache
    stats = json.loads((Path(hf.state) / "state.json").read_text())["trees"]
    assert stats["trees_built"] == 0 and stats["lazy_trees"] >= 1, stats
    listing = netns.run(["iptables-save", "-t", "filter"], fw)
    leaves = {ln.split()[1] for ln in listing.splitlines() if re.match(rf"-A {gen2}L\d+A\d+ ", ln)}
    divert = re.compile(rf"-p (17|udp) -m iprange --src-range 10.0.1.0-10.0.1.127 -j {gen2}TD\d+$")
    trees_jumped = [
        leaf for leaf in leaves if any(re.match(rf"-A {leaf} -j HF\d+_T", ln) for ln in listing.splitlines())
    ]
    assert trees_jumped and all(
        any(ln.startswith(f"-A {leaf} ") and divert.search(ln) for ln in listing.splitlines()) for leaf in trees_jumped
    ), [ln for ln in listing.splitlines() if ln.startswith(f"-A {gen2}L")]
    td = [ln for ln in listing.splitlines() if re.match(rf"-A {gen2}TD\d+ ", ln)]
    assert any(re.search(r"-s 10.0.1.0/25 .*--string \"?BAD\"? ", ln) for ln in td), td

    st = hf("status", check=False)
    assert st.returncode == 0 and re.search(r"trees .* \d+ kept from the last rebuild", st.stdout), st.stdout

    r = _verify(hf)
    diverted = _counted(fw, rf"-A {gen2}L\d+A\d+ .*-j {gen2}TD\d+")
    walked = _counted(fw, rf"-A {gen2}L\d+A\d+ -j HF\d+_T\d+")
    print(f"lazy: {diverted} frames diverted, {walked} walked the kept trees; {r['packets']} frames")
    assert diverted > 0 and walked > 0

    # the service's worker restarted (SIGKILL: its supervisor starts the next one, a new process without trees); then
    # the operator deletes one of the deployed complex rules: two changes since the deploy, the trees kept (written
    # without the deleted rule's copies in their leaves) where the two diversions write fewer rules than the tree,
    # else built anew (`rebuilt_cheaper`); none built for want of the trees in the new process
    svc = hf.service()
    os.kill(svc["worker"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while hf.service().get("restarts", 0) <= svc.get("restarts", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hf.followed().get("restarts", 0) > svc.get("restarts", 0)
    netns.run(["iptables", "-w", "-D", "FORWARD", *CX[2].split()[2:]], fw)
    hf.followed()
    stats = json.loads((Path(hf.state) / "state.json").read_text())["trees"]
    assert stats["trees_built"] == stats["rebuilt_cheaper"] and stats["lazy_trees"] >= 1, stats
    gen3, trees3 = _tree_chains(fw)
    assert gen3 != gen2 and not any('"EVIL2"' in ln for ln in trees3), trees3
    kept = set(trees3) & set(trees1)
    if not stats["rebuilt_cheaper"]:
        assert trees3 == sorted({ln for ln in trees1 if '"EVIL2"' not in ln}), "the follow rewrote the trees"
    _verify(hf)
    gone = _counted(fw, rf"-A {gen3}L\d+A\d+ .*--src-range 10.0.1.32-10.0.1.47 -j {gen3}TD\d+")
    print(f"delete: {stats}, {len(kept)} of {len(trees1)} tree rules kept, {gone} frames diverted")
    assert gone > 0, "frames in the deleted rule's source went to its diversion"

    # a sparse change last (a ban of a source no rule names, the common case of fail2ban-like tools): few rules loaded
    loaded, total = _follow_loads(hf, fw, ["-I", "FORWARD", "5", *SPARSE_BAN.split()], trees_kept=False)
    print(f"sparse follow: {loaded} of the tool's {total} rules loaded")
    assert 0 < loaded * 3 < total, (loaded, total)
    _verify(hf)

    # a rule added by hand to a chain the follows kept is drift; the next follow loads every chain anew (keeping the
    # chain would keep the rule and make it part of the fingerprint drift compares, so status would stop naming it)
    gen4 = re.search(r"-j (HF\d+_)MAIN", netns.run(["iptables-save", "-t", "filter"], fw)).group(1)
    kept_chain = sorted(c for c in _tool_chains(fw) if not c.startswith(gen4) and re.match(r"HF\d+_T\d+$", c))[0]
    netns.run(["iptables", "-w", "-I", kept_chain, "1", "-j", "ACCEPT"], fw)
    assert hf("status", check=False).returncode == 1
    loaded, total = _follow_loads(hf, fw, ["-I", "FORWARD", "5", *SPARSE_BAN2.split()], trees_kept=False)
    assert loaded == total, (loaded, total)
    assert kept_chain not in _tool_chains(fw)
    assert hf("status", check=False).returncode == 0
    _verify(hf)
    hf("undeploy", "-q")


def test_the_xdp_program_marks_only_trusted_unparsed_ipv4_frames_for_the_k0_tree():
    """The xdp program alone (BPF_PROG_TEST_RUN in a scratch namespace): with CONTROL bit 6 an IPv4 frame it passes
    unparsed (a first fragment, a bad header checksum) carries HF_MARK_K0_TREE; under its shunt-everything (control
    0, the fail safe) and with an expired lease it carries 0, as do frames that are not IPv4 (IPv6, an unknown
    ethertype): those go to the live rules."""
    need_root()
    need_tool("clang", "cc", "make", "ip")
    import random

    from hypafilter.analysis.plan import build_plan
    from hypafilter.analysis.program import K0_TREE
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.verify import build_frame, malform
    from hypafilter.targets.xdp.run import run_frames
    from hypafilter.targets.xdp.target import CONTROL_ENABLE, CONTROL_K0_TREE

    example = ROOT / "rulesets" / "example.rules"
    plan = build_plan(parse_policy(example.read_text(), str(example)), Config())
    rng = random.Random(3)
    udp = build_frame(1, {"src": 0x0A000101, "dst": 0x0A000201, "proto": 17, "sport": 1000, "dport": 53}, b"x")
    v6 = udp[:12] + b"\x86\xdd" + bytes([0x60, 0, 0, 0, 0, 8, 17, 64]) + bytes(32) + bytes(8)
    frames = [(0, malform("fragment_first", udp, rng)), (0, malform("bad_ip_checksum", udp, rng)), (0, v6)]
    frames.append((0, udp[:12] + b"\x88\xb6" + udp[14:]))
    ns = f"q6k0-{os.getpid()}"
    netns.delete(ns)
    netns.add(ns)
    try:
        netns.run(["ip", "-n", ns, "link", "add", "c0", "type", "veth", "peer", "name", "c1"])
        for i in ("c0", "c1"):
            netns.run(["ip", "-n", ns, "link", "set", i, "up"])

        def values(control: int, lease_ns: int = 0) -> list[int]:
            res = run_frames(plan, frames, ["c0", "c1"], ns=ns, control=control, lease_ns=lease_ns)
            return [v.value for v in res.verdicts]

        assert values(CONTROL_ENABLE | CONTROL_K0_TREE) == [K0_TREE, K0_TREE, 0, 0]
        assert values(CONTROL_K0_TREE) == [0, 0, 0, 0]  # not enabled: the fail safe's control 0
        assert values(CONTROL_ENABLE | CONTROL_K0_TREE, lease_ns=1) == [0, 0, 0, 0]  # the lease long past
    finally:
        netns.delete(ns)

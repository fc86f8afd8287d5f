"""The SFL update buffer in the XDP program, for real (BPF_PROG_TEST_RUN): a program built for one policy, its valid
mask and buffer slots written with the overlay `analysis.overlay.align` computes for a changed policy (rules
inserted, deleted, a verdict changed, a multiport rule: one slot per port), decides every frame as `hw.model.decide`
over that View — which decides by `analysis.overlay.hw_indices`, the one definition —: XDP action, hardware index
(slots n + 1 + b), reason, M, mark value, counters and the hits of every row. Through a fresh program with the
overlay in its tables file, and through a started program (XdpTarget) whose overlay `write_overlay` changes from one
change to the next while it runs; `read_overlay` reads back what was written."""

from __future__ import annotations

import random
import re
import time

import pytest

from conftest import full_beyond
from tests.system.test_xdp import PORTS, check, frames_for, veth_namespace

pytestmark = pytest.mark.system

NS = "exov-run"
SITE = "exov"  # names the started program's pins (/sys/fs/bpf/hypafilter-xdp/exov)
MULTIPORT = "-A FORWARD -p tcp -m multiport --dports 22,80,443,8080 -j DROP"


@pytest.fixture(scope="module")
def ns():
    with veth_namespace(NS) as name:
        yield name


def _flip(line: str) -> str:
    """The rule with the other verdict (a jump to a user chain or a complex target stays as it is)."""
    if line.endswith("-j ACCEPT"):
        return line[: -len("ACCEPT")] + "DROP"
    if line.endswith("-j DROP"):
        return line[: -len("DROP")] + "ACCEPT"
    return line


def changed(text: str, rng: random.Random, inserts: int = 3, deletes: int = 2, before_self: int = 1) -> str:
    """`text` changed as iptables -I / -D / -R would: `deletes` FORWARD rules deleted, one rule's verdict changed in
    place, `before_self` rules each preceded by a copy with the other verdict (its slot placed right before the
    static entry it copies, so the frames of that entry need pos <= i to reach the slot), `inserts` such copies
    inserted anywhere, and MULTIPORT (four boxes)."""
    lines = text.splitlines()
    at = [i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD ")]
    body = [lines[i] for i in at]
    for _ in range(min(deletes, len(body) - 1)):
        del body[rng.randrange(len(body))]
    j = rng.randrange(len(body))
    body[j] = _flip(body[j])
    for j in sorted(rng.sample(range(len(body)), min(before_self, len(body))), reverse=True):
        body.insert(j, _flip(body[j]))
    for _ in range(inserts):
        body.insert(rng.randint(0, len(body)), _flip(rng.choice(body)))
    body.insert(rng.randint(0, len(body)), MULTIPORT)
    rest = [ln for i, ln in enumerate(lines) if i not in set(at)]
    first = at[0] if at else next(i for i, ln in enumerate(rest) if ln == "COMMIT")
    return "\n".join(rest[:first] + body + rest[first:]) + "\n"


def views(text: str, seed: int, depth: int, modes=("index", "selective", "exact")):
    """(mode, static plan, master policy, View) for `text` and a change of it, in each mode whose change fits the
    buffer."""
    from hypafilter.analysis.overlay import BufferFull, align
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    policy = parse_policy(text, f"p{seed}")
    master_policy = parse_policy(changed(text, random.Random(seed)), f"p{seed}'")
    out = []
    for mode in modes:
        static = build_plan(policy, Config(shunt_mode=mode))
        master = build_plan(master_policy, Config(shunt_mode=mode))
        try:
            out.append((mode, static, master_policy, align(static.entries, master, depth)))
        except BufferFull:
            continue
    return policy, out


def mixed_frames(old, new, seed, count: int):
    """Frames drawn from both policies' rules (the deleted ones' too), a third malformed."""
    rng = random.Random(seed)
    return frames_for(new, rng, count - count // 3) + frames_for(old, rng, count // 3)


@pytest.mark.parametrize("seed", full_beyond(range(1, 11), keep=1))
def test_fuzz_policy_changed(ns, seed):
    """The fuzzer's policies (negations, multiport, ICMP, TCP flags, user chains, complex rules) in every shunt
    mode: every frame and counter of the static program with the overlay against the model over the View."""
    from hypafilter.tools.fuzz import random_policy

    policy, vs = views(random_policy(seed, conntrack=False), seed, 64)
    assert vs, "no change fits the buffer"
    slotted = 0
    for mode, _, master_policy, view in vs:
        assert view.overlay.slots, mode
        tally = check(view, mixed_frames(policy, master_policy, seed, 900), ns)
        assert tally[("SLOT", None)] > 0, (mode, tally)
        slotted += view.overlay.used
        print(seed, mode, view.overlay.used, "slots", int((~view.overlay.valid).sum()), "masked", dict(tally))
    assert slotted >= 4 * len(vs)  # MULTIPORT alone takes four


def test_slots_decide(ns):
    """The slots really decide (their rows' hits), a multiport rule in one slot per port, and a program with a larger
    buffer (unused slots shunting, never read) decides the same."""
    from hypafilter.targets.xdp.run import run_frames
    from hypafilter.targets.xdp.tables import build_tables
    from hypafilter.tools.fuzz import random_policy

    policy, vs = views(random_policy(4, conntrack=False), 4, 16, modes=("selective",))
    _, _, master_policy, view = vs[0]
    ports = {s.box.lo[4] for s in view.overlay.slots if s.box.lo[4] == s.box.hi[4]}
    assert {22, 80, 443, 8080} <= ports, ports
    frames = mixed_frames(policy, master_policy, 40, 1200)
    tally = check(view, frames, ns)
    res = run_frames(view, frames, PORTS, ns=ns, generation=7)
    assert sum(res.counters["HITS"][view.n + 1 :]) > 0, "no frame decided by a slot"
    assert check(view, frames, ns, shape=build_tables(view).shape(64)) == tally


CT_POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 -j ACCEPT
-A FORWARD -p udp -m udp --dport 53 -j ACCEPT
-A FORWARD -p tcp -j DROP
COMMIT
"""


def test_ct_hit_entry_masked_off():
    """hfx_config.ct_hit (a conntrack hit's entry, taken without a lookup) gives way to the valid mask: with the
    ESTABLISHED rule deleted, frames of connections the kernel's own table holds as established (ct 1/2, looked up
    in a namespace of their own) are classified as the changed policy says, not accepted by entry 0."""
    from hypafilter.analysis.overlay import align
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.hw import model
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.verify import build_frame
    from hypafilter.targets.xdp.run import XDP_DROP, XDP_PASS, XDP_REDIRECT, run_frames
    from hypafilter.targets.xdp.tables import build_tables
    from hypafilter.targets.xdp.target import read_ct_config
    from hypafilter.tools.bench.ctflows import open_flows

    cfg = Config(shunt_mode="selective")
    static = build_plan(parse_policy(CT_POLICY, "ct"), cfg)
    master = build_plan(parse_policy(re.sub(r"-A FORWARD -m conntrack.*\n", "", CT_POLICY), "ct'"), cfg)
    assert build_tables(static).ct_hit[0]  # the shortcut is there
    view = align(static.entries, master, 16)
    assert not view.overlay.valid[0]
    rng = random.Random(5)
    frames, flows, cts = [], [], []
    for uid in range(1, 201):
        proto, dport = rng.choice(((6, 22), (17, 53), (6, 80), (17, 99)))
        h = {"src": 0x0A000001 + uid, "dst": 0x0A640001, "proto": proto, "sport": 20000 + uid, "dport": dport}
        h["flags"] = 0x10 if proto == 6 else 0
        flows.append((proto, h["src"], h["dst"], h["sport"], h["dport"]))
        frames.append((uid % 2, build_frame(uid, h, b"")))
        cts.append(1)
    with veth_namespace("exov-ct", PORTS, ("conntrack", "sysctl")) as ns:
        open_flows(ns, flows)
        ct = read_ct_config(ns)
        assert ct.lookup
        got = {}
        for name, plan in (("static", static), ("view", view)):
            regs = model.Regs.from_plan(plan)
            res = run_frames(plan, frames, PORTS, ns=ns, control=regs.control, ct=ct)
            for (iport, f), c, v in zip(frames, cts, res.verdicts, strict=True):
                d = model.decide(plan, f, (0x01, 0x04)[iport], regs, ct=c)
                want = {model.Kind.DROP: XDP_DROP, model.Kind.FORWARD: XDP_REDIRECT}.get(d.kind, XDP_PASS)
                assert (v.retval, v.meta & 0xFFFFFF) == (want, d.match_index), (name, f.hex(), d, v)
            got[name] = {v.meta & 0xFFFFFF for v in res.verdicts}
        assert got["static"] == {0} and 0 not in got["view"], got


def test_write_overlay_on_a_running_program(ns, tmp_path):
    """XdpTarget: a started program of one policy, its tables written, then `write_overlay` of one change after
    another (Views: rows too), each time every frame against the model over that View; `read_overlay` gives what was
    written; back to the identity overlay, the static policy's decisions. Measures write_overlay's time (full
    buffer plus valid mask)."""
    from hypafilter.analysis.overlay import Overlay, align
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.errors import HypafilterError
    from hypafilter.iptables.document import parse_policy
    from hypafilter.targets.base import Site
    from hypafilter.targets.xdp.target import XdpTarget, overlay_state
    from hypafilter.tools.fuzz import random_policy

    text = random_policy(6, conntrack=False)
    policy = parse_policy(text, "p6")
    cfg = Config(shunt_mode="selective", update_buffer=16)
    tgt = XdpTarget(cfg, Site(SITE, NS, {"wire0": PORTS[0], "wire1": PORTS[1]}, tmp_path))
    static = build_plan(policy, cfg)
    info = tgt.start(tgt.build(static), 7)
    try:
        tgt.program(info, static, 7)
        none = tgt.ct_config(static).none  # a miss is ct 3 where nothing makes it RELATED (docs/xdp.md "New flows")
        assert overlay_state(tgt.read_overlay(info)) == overlay_state(Overlay.empty(static.n, 16))
        took = []
        m0, m1, m2 = (changed(text, random.Random(100 + k), inserts=2 + k) for k in range(3))
        # m1 twice: nothing to write the second time; then m1 with one more rule at the end (its four slots appended,
        # every other slot unchanged and enabled throughout); then m2 and m0 (slots rewritten, shifted)
        m1_more = m1.replace("COMMIT", MULTIPORT.replace("DROP", "ACCEPT") + "\nCOMMIT")
        masters = [m0, m1, m1, m1_more, m2, m0]
        for k, mtext in enumerate(masters):
            master_policy = parse_policy(mtext, f"p6.{k}")
            view = align(static.entries, build_plan(master_policy, cfg), 16)
            t0 = time.perf_counter()
            out = tgt.write_overlay(info, view)
            took.append((round(time.perf_counter() - t0, 4), out["us"], out["slots_changed"], out["rows_changed"]))
            assert out["buf_scan"] == view.overlay.used
            assert overlay_state(tgt.read_overlay(info)) == overlay_state(view.overlay) == out["overlay"]
            if k == 2:
                assert (out["slots_changed"], out["rows_changed"]) == (0, 0), out
            if k == 3:
                assert out["slots_changed"] == 4, out  # the appended rule's four boxes, nothing else
            check(view, mixed_frames(policy, master_policy, k, 600), ns, pin=info["pin"], none=none)
        # drift compares the state's record with what the program holds (the links are not ours to check here)
        st = {"generation": 7, "tables": {"miss_shunt": [False, False], "overlay": out["overlay"]}}
        assert not [d for d in tgt.drift(info, st) if "update buffer" in d]
        st["tables"]["overlay"] = overlay_state(Overlay.empty(static.n, 16))
        assert [d for d in tgt.drift(info, st) if "update buffer" in d]
        with pytest.raises(HypafilterError, match="an overlay for"):  # another matcher's: refused, nothing written
            tgt.write_overlay(info, Overlay.empty(static.n + 1, 16))
        assert overlay_state(tgt.read_overlay(info)) == overlay_state(view.overlay)
        ident = align(static.entries, static, 16)
        assert ident.overlay.pristine
        tgt.write_overlay(info, ident)
        assert tgt.read_overlay(info).pristine
        check(ident, frames_for(policy, random.Random(9), 600), ns, pin=info["pin"], none=none)
        print("write_overlay (s, loader us, slots, rows):", took)
    finally:
        tgt.stop(info)

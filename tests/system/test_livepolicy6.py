"""ip6tables is the live IPv6 policy (issue #25, docs/ipv6.md "Following ip6tables"): on a dual-stack deployment whose
IPv6 side the xdp program decides (`xdp_ipv6 = true`), an IPv6 ban inserted with the real `ip6tables -I` (what
fail2ban's and ufw's IPv6 actions do) holds on the hybrid path exactly as in the kernel alone: the policy sync
service holds the program's IPv6 path at once, rebuilds the IPv6 table set from ip6tables and lets it decide again.
The banned datagrams are dropped, the others still delivered; `verify --live` (both families' live rulesets alone in
the oracle's namespace) finds 0 mismatches while the program still decides IPv6 frames; the IPv4 side never failed
safe for it. Lifting the ban lets the datagrams through again."""

from __future__ import annotations

import os
import re
import time

import pytest
from hypafilter import netns
from hypafilter.ops.connections import UdpServers
from hypafilter.ops.lab import Lab

from conftest import ROOT
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "q5l"
FW = f"{LAB}-fw"
hf = HfCli(LAB, f"/run/hypafilter/test-{LAB}")
SENDER, RECEIVER = Lab.ip6("send"), Lab.ip6("recv")  # the hybrid path's IPv6 addresses (fd48:4600::/64)
BANNED, OTHER = 53, 5000  # both accepted by V6 from the sender; the ban is fail2ban-style: the sender on udp/53
V6 = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
-A FORWARD -p ipv6-icmp --icmpv6-type neighbour-solicitation -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type neighbour-advertisement -j ACCEPT
-A FORWARD -p ipv6-icmp --icmpv6-type echo-request -j ACCEPT
-A FORWARD -s fd48:4600::/64 -p udp --dport 53 -j ACCEPT
-A FORWARD -s fd48:4601::/64 -p udp --dport 53 -j ACCEPT
-A FORWARD -s 2001:db8:1::/48 -p tcp --dport 80 -j ACCEPT
-A FORWARD -p udp --dport 5000:5100 -j ACCEPT
-A FORWARD -p tcp --dport 8080 -j REJECT --reject-with icmp6-port-unreachable
COMMIT
"""
PACKETS = 60  # verify's frames per family
FULL = os.environ.get("HF_LIVEPOLICY6_FULL") == "1"
IDLE_S = 4  # the opt-in run's idle time before the IPv6 buffer's lazy rebuild (the service's default: 60 s)
BAN = ["FORWARD", "-s", f"{SENDER}/128", "-p", "udp", "--dport", str(BANNED), "-j", "DROP"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = tmp_path_factory.mktemp(LAB)
    (d / "v6.rules").write_text(V6)
    (d / "cfg.toml").write_text("xdp_ipv6 = true\n")
    if FULL:  # the IPv6 buffer's idle rebuild within the opt-in test (the service inherits the deploy's environment)
        os.environ["HF_REBUILD6_IDLE_S"] = str(IDLE_S)
    try:
        with hf.xdp_lab():
            (d / "ip6tables.before").write_text(operator6())  # what undeploy gives back (test_undeploy_...)
            hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--ipv6", str(d / "v6.rules"), "--target", "xdp",
               "--config", str(d / "cfg.toml"), "-q")  # fmt: skip
            yield d
    finally:
        os.environ.pop("HF_REBUILD6_IDLE_S", None)  # (later modules' services keep the default)


def operator6() -> str:
    """ip6tables of the firewall namespace as policy lines (no comments, no counters)."""
    saved = netns.run(["ip6tables-save"], FW)
    return "".join(re.sub(r" \[\d+:\d+\]$", "", ln) + "\n" for ln in saved.splitlines() if not ln.startswith("#"))


def ip6t(*args: str) -> None:
    netns.run(["ip6tables", "-w", *args], FW)


def delivered() -> list[int]:
    """The ports whose datagram from the sender reached the receiver over IPv6 on the hybrid path."""
    with UdpServers(f"{LAB}-recv", [BANNED, OTHER], family=6) as srv:
        with netns.inside(f"{LAB}-send"):
            import socket

            tx = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        try:
            for port in (BANNED, OTHER):
                tx.sendto(b"query", (RECEIVER, port))
            srv.quiet(0.25)
        finally:
            tx.close()
    return sorted({port for _, _, port, _ in srv.got})


def held(cli: HfCli) -> bool | None:
    """The running program's IPv6 hold word (None: no IPv6 table set)."""
    from hypafilter.ops import deploy
    from hypafilter.targets.xdp.target import XdpTarget

    st = deploy.read_state(f"{cli.state}/state.json")
    return XdpTarget(deploy.deployed_config(st)).ipv6_held(st["nic"])


def state() -> dict:
    from hypafilter.ops import deploy

    return deploy.read_state(f"{hf.state}/state.json")


def leaf_packets(k_base: int) -> dict[str, int]:
    """Packets of the dispatch rules into the IPv6 leaves (ip6tables' counters), by leaf; every leaf's k > k_base (a
    leaf a follow loaded is named after its generation, HFv6_<g>_L<k>A<a>)."""
    saved = netns.run(["ip6tables-save", "-c", "-t", "filter"], FW)
    out: dict[str, int] = {}
    for n, v, k, a in re.findall(
        r"^\[(\d+):\d+\] -A HFv6_\w+ -m mark --mark (0x[0-9a-f]+) -j HFv6_(?:\d+_)?L(\d+)A(\d+)$", saved, re.M
    ):
        assert int(k) > k_base and int(v, 16) >> 4 == int(k), (k, v, k_base)
        out[f"L{k}A{a}"] = out.get(f"L{k}A{a}", 0) + int(n)
    return out


def prog_id(nic: dict) -> int:
    """The kernel's id of the running XDP program (bpftool, by its pin)."""
    import json

    return json.loads(netns.run(["bpftool", "-j", "prog", "show", "pinned", f"{nic['pin']}/prog"]))["id"]


def ipv6_settled(applied: int, timeout: float = 10.0) -> dict:
    """The service's IPv6 part once it has applied `applied` ip6tables changes and holds nothing ({} if not)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        six = hf.service().get("ipv6") or {}
        if six.get("applied", 0) >= applied and not six.get("safe") and six.get("following"):
            return six
        time.sleep(0.05)
    return {}


def test_an_ip6tables_ban_holds_in_xdp_and_lifts(lab):
    assert delivered() == [BANNED, OTHER]  # both decided in XDP by the deployed IPv6 side
    before = hf.service()
    base6 = (before.get("ipv6") or {}).get("applied", 0)

    nic0 = state()["nic"]
    id0 = prog_id(nic0)
    ip6t("-I", *BAN[:1], "1", *BAN[1:])
    six = ipv6_settled(base6 + 1)
    assert delivered() == [OTHER]  # the ban holds on the hybrid path (main: both delivered, XDP's old tables)
    # held, then written into the IPv6 update buffer (docs/ipv6.md "The update buffer for IPv6"): the same program,
    # its IPv6 lookup maps those of the deployed policy, the ban a slot ahead of them
    assert six.get("last_how") == "buffer" and six["lag_safe_ms"]["n"] >= 1, six
    st = state()
    assert st["nic"] == nic0 and prog_id(st["nic"]) == id0, (nic0, st["nic"])
    buf6 = st["tables"]["v6"]["buffer"]
    assert buf6["used"] == 1 and not buf6["invalid"], buf6
    line = next(ln for ln in hf("status").stdout.splitlines() if ln.startswith("ipv6 "))  # exit 0: no drift
    assert f"with 1 of {buf6['depth']} IPv6 update-buffer slots and 0 entries masked off" in line, line
    # the slot disabled by hand is drift (status reads the buffer back word for word); written back, none
    from hypafilter.targets.bpfmap import PinnedArray

    with PinnedArray(f"{st['nic']['pin']}/hfx6_buf") as m:
        row = m.read(0)
        m.write_many([row[:-4] + bytes(4)])  # struct hfx6_slot's last word: enable
        r = hf("status", check=False)
        m.write_many([row])
    assert r.returncode == 1 and "DRIFT" in r.stdout and "IPv6 update buffer" in r.stdout, r.stdout
    # so is the slot's row (hfx6_ent: its action changed by hand, a verdict the deployment does not hold) and a word
    # of the valid mask (hfx6_vbox: a static box taken out): status reads back every map the buffer's write rewrites
    n6 = st["tables"]["v6"]["entries"]
    for name, index in (("hfx6_ent", n6 + 1), ("hfx6_vbox", 0)):
        with PinnedArray(f"{st['nic']['pin']}/{name}") as m:
            row = m.read(index)
            m.write(bytes([row[0] ^ 1]) + row[1:], index)
            r = hf("status", check=False)
            m.write(row, index)
        print(f"{name}[{index}] changed by hand: {[ln for ln in r.stdout.splitlines() if name in ln]}")
        assert r.returncode == 1 and f"IPv6 update buffer: {name}" in r.stdout, (name, r.stdout)  # main: exit 0
    assert hf("status", check=False).returncode == 0
    after = hf.service()
    assert after["changes"] == before["changes"] and after["resyncs"] == before["resyncs"], after  # IPv4 untouched

    # ip6tables holds the new IPv6 plan's interval chains (k after the IPv4 plan's), the jump first again, the
    # operator's ban after it: the tool's chains rewritten, the operator's rules untouched
    kb = state()["ipv6"]["chains"]["k_base"]
    saved = netns.run(["ip6tables-save", "-t", "filter"], FW)
    forward = [ln for ln in saved.splitlines() if ln.startswith("-A FORWARD ")]
    assert forward[:2] == ["-A FORWARD -j HFv6_MAIN", f"-A FORWARD -s {SENDER}/128 -p udp -m udp --dport 53 -j DROP"]
    assert saved.count("-j HFv6_MAIN") == 1, saved

    before_leaves = leaf_packets(kb)
    t = time.monotonic()
    r = hf.verify_live(packets=PACKETS)  # both families' live rulesets alone in the oracle's namespace
    print(f"verify --live: {time.monotonic() - t:.1f} s, unparsed {r['nic']['CNT_SHUNT_UNPARSED']}, {r['ipv6']}")
    assert r["ipv6"]["mismatches"] == 0 and r["ipv6"]["packets"] == PACKETS, r["ipv6"]
    # the program still decides IPv6 frames itself (every one of them unparsed while held)
    assert r["nic"]["CNT_SHUNT_UNPARSED"] < PACKETS, r["nic"]
    # ... and among them frames shunted with the new plan's k > k_base ran their interval chain in ip6tables (the
    # counters of MAIN's dispatch into the leaves), with ip6tables-alone's verdict
    shunted = sum(leaf_packets(kb).values()) - sum(before_leaves.values())
    print(f"IPv6 frames into leaves of k > {kb} during verify --live: {shunted}")
    assert shunted > 0, leaf_packets(kb)

    ip6t("-D", *BAN)
    six = ipv6_settled(base6 + 2)
    assert six, hf.service().get("ipv6")

    # an IPv4 change leaves the IPv6 side alone: no IPv6 change, the hold word clear, IPv6 decided in XDP
    netns.run(["iptables", "-w", "-I", "FORWARD", "1", "-s", "10.0.1.1/32", "-j", "DROP"], FW)
    deadline = time.monotonic() + 10
    while not ((doc := hf.service()).get("applied", 0) > after["applied"] and not doc.get("safe")):
        assert time.monotonic() < deadline, doc
        time.sleep(0.05)
    assert doc["ipv6"]["changes"] == six["changes"] and not doc["ipv6"]["safe"], doc["ipv6"]
    assert held(hf) is False
    assert delivered() == [BANNED, OTHER]
    from hypafilter.ops import deploy

    follows = [h for h in deploy.read_state(f"{hf.state}/state.json")["history"] if h.get("kind") == "follow6"]
    print(
        f"policysync IPv6: {six['lag_safe_ms']} ms to the hold, {six['lag_apply_ms']} ms to the new tables, "
        f"of which deploy.follow6 {[h['duration_s'] for h in follows]} s"
    )
    lines = hf("status").stdout.splitlines()  # exit 0: no drift (ip6tables is the deployment's IPv6 side)
    assert any(ln.startswith("ipv6     IPv6 policy live ip6tables") for ln in lines), lines
    assert any(ln.startswith("policysync") and "IPv6: following ip6tables" in ln for ln in lines), lines


def test_maps_left_unknown_by_a_failed_follow_are_rewritten_whole(lab):
    """A follow that fails while it writes the program's IPv6 maps (an OSError of a map write, ip6tables-save failing
    for the fingerprint after them) leaves the state saying so (deploy.follow6's `tables.v6.writing`, its `static`
    gone), as it writes before its first map write. The service must then rewrite the whole IPv6 table set, never
    align a buffer change to a static plan the maps may no longer hold (which could give a row another entry's
    verdict), and never release over half-written maps. The state is set here as such a failure leaves it."""
    import json

    st = state()
    v6 = st["tables"]["v6"]
    assert v6.get("static") and not v6.get("writing"), v6
    base6 = (hf.service().get("ipv6") or {}).get("applied", 0)
    st["tables"]["v6"] = {**v6, "static": None, "writing": True}
    path = f"{hf.state}/state.json"
    with open(path + ".t", "w") as f:
        json.dump(st, f, indent=1, sort_keys=True)
    os.replace(path + ".t", path)
    ip6t("-I", *BAN[:1], "1", *BAN[1:])
    try:
        six = ipv6_settled(base6 + 1)
        assert six.get("last_how") == "tables", six  # the whole table set, not the buffer (main: "buffer")
        v6 = state()["tables"]["v6"]
        assert "writing" not in v6 and v6.get("static"), v6
        assert delivered() == [OTHER]
    finally:
        ip6t("-D", *BAN)
    assert ipv6_settled(base6 + 2), hf.service().get("ipv6")
    assert delivered() == [BANNED, OTHER]


def ipv6_error(timeout: float = 10.0) -> str:
    """The service's IPv6 error once it has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        err = (hf.service().get("ipv6") or {}).get("error")
        if err:
            return err
        time.sleep(0.05)
    raise AssertionError(f"no IPv6 error within {timeout:g} s: {hf.service().get('ipv6')}")


# With HF_LIVEPOLICY6_FULL=1 (`make test-livepolicy6`): the legacy ip6tables tables and a change that needs a new
# program (not in `make test`: its budget).
if FULL:

    def test_legacy_ip6tables_and_a_new_program(lab):
        applied = (hf.service().get("ipv6") or {}).get("applied", 0)
        # a legacy (xtables) table filters IPv6 beside ip6tables-nft's: held, said, and the kernel's verdict holds
        netns.run(["ip6tables-legacy", "-w", "-I", *BAN], FW)
        assert "legacy ip6tables" in ipv6_error()
        assert delivered() == [OTHER]  # the legacy rule drops it in the kernel; XDP no longer forwards it
        assert hf("status", check=False).returncode == 1
        netns.run(["ip6tables-legacy", "-w", "-D", *BAN], FW)  # the table stays, empty, ACCEPT: it filters nothing
        assert ipv6_settled(applied) and delivered() == [BANNED, OTHER]

        # a destination the IPv6 side never tested (a field the running program's IPv6 table set lacks): a slot of
        # the IPv6 update buffer compares every field, so the same program takes it
        nic0 = state()["nic"]
        ip6t("-I", "FORWARD", "1", "-d", "2001:db8:5::/64", "-j", "DROP")
        six = ipv6_settled(applied + 1, timeout=60)
        assert six.get("last_how") == "buffer" and state()["nic"] == nic0, six
        print(f"IPv6 destination test into the buffer: applied {six['lag_apply_ms']['last']} ms after the event")
        # more than half the buffer in one change (nine more destinations): the lazy rebuild writes the whole IPv6
        # table set, which lacks the field: a new program
        more = "".join(f"-I FORWARD 1 -d 2001:db8:6:{i}::/64 -j DROP\n" for i in range(9))
        netns.run(["ip6tables-restore", "-w", "--noflush"], FW, input=f"*filter\n{more}COMMIT\n")
        six = ipv6_settled(applied + 2, timeout=60)
        assert six.get("last_how") == "new program" and six["new_programs"] >= 1, six
        assert state()["nic"]["pin"] != nic0["pin"]
        print(f"IPv6 lazy rebuild by a new program: applied {six['lag_apply_ms']['last']} ms after the event")
        # the new plan's chains went into ip6tables before the new program tags frames with their k (same k_base)
        kb = state()["ipv6"]["chains"]["k_base"]
        forward = [ln for ln in netns.run(["ip6tables-save", "-t", "filter"], FW).splitlines() if "-A FORWARD" in ln]
        assert forward[:2] == ["-A FORWARD -j HFv6_MAIN", "-A FORWARD -d 2001:db8:6:8::/64 -j DROP"], forward
        before = sum(leaf_packets(kb).values())
        r = hf.verify_live(packets=PACKETS)
        assert r["ipv6"]["mismatches"] == 0, r["ipv6"]
        assert sum(leaf_packets(kb).values()) > before  # frames shunted with k > k_base among them
        assert delivered() == [BANNED, OTHER]
        ip6t("-D", "FORWARD", "-d", "2001:db8:5::/64", "-j", "DROP")
        six = ipv6_settled(applied + 3)
        assert six and six.get("last_how") == "buffer", six  # the new program's buffer takes the deletion
        nic1 = state()["nic"]
        rebuilds = (hf.service().get("ipv6") or {}).get("rebuilds", 0)  # (the main test's buffer may have had one)
        assert state()["tables"]["v6"]["buffer"]["invalid"], state()["tables"]["v6"]  # its entry masked off
        # idle for IDLE_S: the lazy rebuild rewrites the IPv6 table set in the same program, the buffer empty again
        deadline = time.monotonic() + IDLE_S + 10
        while (hf.service().get("ipv6") or {}).get("rebuilds", 0) <= rebuilds:
            assert time.monotonic() < deadline, hf.service().get("ipv6")
            time.sleep(0.2)
        buf6 = state()["tables"]["v6"]["buffer"]
        assert buf6["used"] == 0 and "invalid" not in buf6 and state()["nic"] == nic1, buf6
        assert ipv6_settled(applied + 3) and delivered() == [BANNED, OTHER]
        r = hf.verify_live(packets=PACKETS)
        assert r["ipv6"]["mismatches"] == 0, r["ipv6"]


def test_undeploy_gives_the_operators_ip6tables_back(lab):
    """After follows of ip6tables (the tool's chains rewritten there), undeploy gives back ip6tables as it was
    before the first deploy, the tool's chains and jump gone (the IPv6 side's give-back: docs/ipv6.md)."""
    assert "HFv6_MAIN" in operator6()
    hf("undeploy", "-q")
    assert operator6() == (lab / "ip6tables.before").read_text()

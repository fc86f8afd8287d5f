"""`verify` on policies with rate limits and timed lists (-m limit, -m hashlimit, -m recent --seconds): verified
against the kernel rather than refused (docs/verify.md, "Rate limits and timed lists"). ufw's default policy (its
limits only decide what is logged), ufw's `limit ssh` (a recent list with a 30 s window deciding REJECT), a hashlimit
policy whose buckets run out during the run; and verify catching a hybrid whose copy of a limited rule is wrong."""

from __future__ import annotations

import shlex

import pytest
from hypafilter.config import Config
from hypafilter.iptables.document import parse_policy
from hypafilter.ops import deploy
from hypafilter.ops.verify import refuse_nondeterministic, verify

from conftest import ROOT, ns_sh

pytestmark = pytest.mark.system

LAB = "vlm"
REAL = ROOT / "rulesets" / "real"
SSH_SOURCES = 6  # spoofed sources, each opening SSH_TRIES new connections to port 22
SSH_TRIES = 9

HASHLIMIT = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 --tcp-flags FIN,SYN,RST,ACK SYN -m hashlimit --hashlimit-above 2/min --hashlimit-burst 4 --hashlimit-mode srcip --hashlimit-name vlmssh -j DROP
-A FORWARD -p tcp -m tcp --dport 22 -j ACCEPT
-A FORWARD -p udp -m udp --dport 53 -m hashlimit --hashlimit-upto 1/min --hashlimit-burst 3 --hashlimit-mode srcip,dstport --hashlimit-name vlmdns -j ACCEPT
-A FORWARD -p tcp -m multiport --dports 80,443 -j ACCEPT
-A FORWARD -p icmp -m icmp --icmp-type 8 -m limit --limit 1/min --limit-burst 3 -j ACCEPT
COMMIT
"""


def trace(tmp_path, rows: list[tuple[int, int, int, int, int, int]]) -> str:
    """A ClassBench trace file (SRC DST SPORT DPORT PROTO FLAGS) of `rows`, which verify sends in order."""
    f = tmp_path / "limits.trace"
    f.write_text("".join(" ".join(map(str, r)) + "\n" for r in rows))
    return str(f)


def floods(tries: int, sources: int, dport: int, proto: int, flags: int) -> list[tuple[int, int, int, int, int, int]]:
    """`tries` new flows from each of `sources` sources to `dport`, the sources taking turns."""
    return [
        (0x0A090000 + s, 0x0A0A0001, 30000 + 100 * s + t, dport, proto, flags)
        for t in range(tries)
        for s in range(sources)
    ]


def tamper(ns: str, needle: str, old: str, new: str) -> None:
    """In `ns`, replace every rule holding `needle` by itself with `old` replaced by `new` (iptables -R): a
    firewall whose copy of the rule is wrong."""
    position: dict[str, int] = {}
    done = 0
    for line in ns_sh(ns, "iptables-save", "-t", "filter").splitlines():
        if not line.startswith("-A "):
            continue
        chain, _, body = line[3:].partition(" ")
        position[chain] = position.get(chain, 0) + 1
        if needle in body:
            ns_sh(ns, "iptables", "-w", "-R", chain, str(position[chain]), *shlex.split(body.replace(old, new)))
            done += 1
    assert done, f"no rule of {ns} holds {needle!r}"


def test_ufw_default_policy(lab, tmp_path):
    """ufw's default policy (`default deny incoming`, allow ssh): its `-m limit` rules (ufw-logging-deny's
    `-m limit ... -j RETURN`, ufw-not-local's `-m limit ... -j ufw-logging-deny`, the LOG rules) only decide what is
    logged, so verify compares it as it is: 0 mismatches in host mode, INPUT deployed on the emulated NIC, with
    enough INVALID frames (SYN+FIN) that the limit of ufw-logging-deny's RETURN ran out in the kernel."""
    deploy.undeploy()
    path = REAL / "ufw-allow-ssh.rules"
    text = path.read_text()
    assert "-m limit --limit 3/min --limit-burst 10 -j RETURN" in text
    assert "-m limit --limit 3/min --limit-burst 10 -j ufw-logging-deny" in text
    pol = parse_policy(text, filename=str(path), base_chain="INPUT", config=Config())
    assert refuse_nondeterministic(pol) == []  # nothing left for the run-time conditions: every limit is neutral
    rows = [
        (0x0A090000 + i % 97, 0x0A0A0001, 20000 + i, port, proto, flags)
        for i in range(800)
        for port, proto, flags in [
            ((22, 80, 443, 5353, 137, 47999)[i % 6], (6, 6, 17, 1)[i % 4], (2, 3, 16, 4, 41)[i % 5])
        ]
    ]
    r = verify(pol, Config(), packets=len(rows), trace=trace(tmp_path, rows), malformed=0.1, bad_share=0.0)
    print({k: r[k] for k in ("packets", "mismatches", "delivered_oracle", "shunted", "hw_forwarded")})
    assert r["nic_mode"] == "host" and r["mismatches"] == 0, r["examples"][:3]
    assert r["observers"]["mismatches"] == 0, r["observers"]["examples"][:3]
    assert 0 < r["delivered_oracle"] < r["packets"]
    # The kernel's own count: the limited RETURN passed its burst and no more (it refused the rest; a token comes
    # back every 20 s, far longer than the run).
    counts = {
        ln.split("] ", 1)[1]: int(ln[1:].split(":")[0])
        for ln in ns_sh(lab.ns_plain, "iptables-save", "-c", "-t", "filter").splitlines()
        if ln.startswith("[")
    }
    assert (
        counts["-A ufw-logging-deny -m conntrack --ctstate INVALID -m limit --limit 3/min --limit-burst 10 -j RETURN"]
        == 10
    )


def test_ufw_limit_ssh(lab, tmp_path):
    """`ufw limit ssh`: a recent list (`--update --seconds 30 --hitcount 6`) REJECTs a source's sixth new SSH
    connection within 30 s. Both paths start with empty lists and the run is shorter than the window, so the
    kernel's lists are the same on both: 0 mismatches, and the limit refused connections (the oracle delivered
    fewer SYNs than were sent, exactly as many per source). Then the firewall's copy of the rule is made wrong
    (hitcount 3): verify reports mismatches, frames and the limited rule's counters both."""
    deploy.undeploy()
    path = REAL / "ufw-limit-ssh.rules"
    pol = parse_policy(path.read_text(), filename=str(path), base_chain="INPUT", config=Config())
    limited = refuse_nondeterministic(pol)
    assert [x.match for x in limited] == ["recent"] and limited[0].seconds == 30
    rows = floods(SSH_TRIES, SSH_SOURCES, 22, 6, 0x02)
    t = trace(tmp_path, rows)
    r = verify(pol, Config(), packets=len(rows), trace=t, malformed=0.0, bad_share=0.0)
    lim = r["limited"]
    print({k: r[k] for k in ("packets", "mismatches", "delivered_oracle")}, lim)
    assert r["mismatches"] == 0 and lim["mismatches"] == 0, (r["examples"][:3], lim["examples"])
    assert lim["rules"][0]["oracle"] > 0 and "under --seconds 30" in lim["rules"][0]["held"]
    # Each source: its first new connections pass, the rest are refused by the list (the kernel's count).
    passed = r["delivered_oracle"]
    assert 0 < passed < len(rows) and passed % SSH_SOURCES == 0, passed

    st = deploy.read_state()
    tamper(lab.ns_fw, "--hitcount 6", "--hitcount 6", "--hitcount 3")
    bad = verify(pol, Config(), packets=len(rows), trace=t, malformed=0.0, bad_share=0.0, live=True)
    print({k: bad[k] for k in ("mismatches", "delivered_oracle", "delivered_hybrid")}, bad["limited"])
    assert bad["generation"] == st["generation"]  # the tampered firewall, not a new deployment
    assert bad["mismatches"] > 0 and bad["delivered_hybrid"] < bad["delivered_oracle"]
    assert bad["limited"]["mismatches"] == 1


def test_hashlimit_policy(lab, tmp_path):
    """A FORWARD policy with two hashlimit tables (SSH SYNs per source `--hashlimit-above 2/min` burst 4 dropped,
    DNS per source and port `--hashlimit-upto 1/min` burst 3 accepted) and a `-m limit` (pings, 1/min burst 3)
    whose buckets run out during the run: the run is shorter than one token's refill, so each bucket passes its
    burst and refuses the rest on both paths. 0 mismatches in bridge mode; then the firewall's copy of the SSH rule
    with a larger burst: exactly its extra SYNs mismatch (the limit's bucket, spent by the first run, is full again
    in both paths: verify renewed the firewall's rule)."""
    deploy.undeploy()
    pol = parse_policy(HASHLIMIT, filename="hashlimit.rules", base_chain="FORWARD", config=Config())
    limited = refuse_nondeterministic(pol)
    assert [(x.match, x.upto, x.burst) for x in limited] == [
        ("hashlimit", False, 4),
        ("hashlimit", True, 3),
        ("limit", True, 3),
    ]
    pings = [(0x0A090100 + i % 2, 0x0A0A0001, 0, 0, 1, 0) for i in range(7)]  # ICMP from a trace: echo requests
    rows = floods(8, 4, 22, 6, 0x02) + floods(6, 3, 53, 17, 0) + floods(3, 3, 80, 6, 0x02) + pings
    t = trace(tmp_path, rows)
    r = verify(pol, Config(), packets=len(rows), trace=t, malformed=0.0, bad_share=0.0)
    lim = r["limited"]
    print({k: r[k] for k in ("packets", "mismatches", "delivered_oracle")}, lim)
    assert r["mismatches"] == 0 and lim["mismatches"] == 0, (r["examples"][:3], lim["examples"])
    ssh, dns, ping = lim["rules"]
    assert ssh["oracle"] == 4 * (8 - 4)  # each source's SYNs past the burst: the DROP rule matched them
    assert dns["oracle"] == 3 * 3  # each source's first three datagrams: the ACCEPT rule matched them
    assert ping["oracle"] == 3  # one bucket for the rule: the first three pings
    assert "one token's refill" in ssh["held"]
    assert r["delivered_oracle"] == 4 * 4 + 3 * 3 + 3 * 3 + 3

    # New tables in the firewall (a table of an existing name keeps its first settings and its spent buckets).
    tamper(lab.ns_fw, "--hashlimit-name vlmssh", "--hashlimit-burst 4", "--hashlimit-burst 6")
    tamper(lab.ns_fw, "--hashlimit-name vlmssh", "--hashlimit-name vlmssh", "--hashlimit-name vlmssh2")
    tamper(lab.ns_fw, "--hashlimit-name vlmdns", "--hashlimit-name vlmdns", "--hashlimit-name vlmdns2")
    bad = verify(pol, Config(), packets=len(rows), trace=t, malformed=0.0, bad_share=0.0, live=True)
    print({k: bad[k] for k in ("mismatches", "delivered_oracle", "delivered_hybrid")}, bad["limited"])
    assert bad["mismatches"] == 4 * 2 and bad["delivered_hybrid"] == bad["delivered_oracle"] + 4 * 2
    assert bad["limited"]["mismatches"] == 2  # the firewall holds neither hashlimit rule as the policy has it
    assert bad["limited"]["rules"][2]["hybrid"] == bad["limited"]["rules"][2]["oracle"] == 3

"""New flows followed live on the xdp target (docs/xdp.md "New flows", "When a miss is not NEW or INVALID"): the
policy sync service withdraws HFX_CT_NONE (a conntrack miss decided as NEW or INVALID) as soon as the firewall
namespace gets what can make such a frame RELATED or UNTRACKED, without `status` or a redeploy, and restores it when
that is gone: a CT helper rule through iptables-nft (an nf_tables event), the same through iptables-legacy (no event:
polled), an expectation created through ctnetlink (`conntrack -I expect`: its EXP_NEW event). With the helper in
place an active-FTP exchange's data connection, RELATED to the kernel and dropped by the policy as NEW, completes
through the hybrid as it does through the plain namespace (the kernel alone, the same policy and helper rule). The
program itself holds from the legacy rule's setsockopt on (the host watcher's count): a new flow's SYN sent the
instant the command returns is not dropped in XDP as NEW."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypafilter import netns

from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "cth"
STATE = f"/run/hypafilter/test-{LAB}"
hf = HfCli(LAB, STATE)
FW, SEND, RECV, PLAIN = (f"{LAB}-{r}" for r in ("fw", "send", "recv", "plain"))

# conntrack first, FTP's control port accepted, everything else dropped: an FTP data connection is accepted only as
# RELATED (the helper's expectation), and as NEW (ct 3) it is dropped
POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 21 -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT
COMMIT
"""
HELPER = ["-t", "raw", "-A", "PREROUTING", "-p", "tcp", "--dport", "21", "-j", "CT", "--helper", "ftp"]

# active FTP, as much as the kernel's helper reads: the client sends PORT, the server connects to it
SERVER = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 21)); s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    f = c.makefile("rb")
    line = f.readline().decode()
    if line.startswith("USER "):  # the helper reads a command only after a line it has seen end
        c.sendall(b"230 in\r\n")
        line = f.readline().decode()
    if line.startswith("PORT "):
        p = line.split()[1].split(",")
        c.sendall(b"200 PORT command successful\r\n")
        try:
            d = socket.create_connection((".".join(p[:4]), int(p[4]) * 256 + int(p[5])), timeout=1.5)
            d.sendall(b"data"); d.close(); c.sendall(b"226 ok\r\n")
        except OSError:
            c.sendall(b"425 no data connection\r\n")
    else:  # a control connection that only stays open (a master for `conntrack -I expect`)
        f.read()
    c.close()
"""
CLIENT = r"""
import socket, sys
server, me, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind((me, port)); l.listen(1)
if len(sys.argv) > 4:  # started ahead: go when told
    print("ready", flush=True); sys.stdin.readline()
c = socket.create_connection((server, 21), timeout=3)
f = c.makefile("rb")
c.sendall(b"USER anonymous\r\n")
f.readline()
c.sendall(("PORT %s,%d,%d\r\n" % (me.replace(".", ","), port >> 8, port & 255)).encode())
f.readline()
print(f.readline().decode().strip())
"""


def ct_flags() -> int:
    from hypafilter.targets.bpfmap import PinnedArray

    st = json.loads((Path(STATE) / "state.json").read_text())
    with PinnedArray(Path(st["nic"]["pin"]) / "hfx_cfg") as m:
        return struct.unpack_from("=I", m.read(), 36)[0]


def decided() -> bool:
    return bool(ct_flags() & 2)


def wait_for(cond, timeout: float, step: float = 0.0005) -> float | None:
    """Seconds until cond() held (None: not within `timeout`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def change(argv: list[str], ns: str = FW) -> tuple[float, float | None]:
    """Run `argv` in `ns`; (its run time, then seconds from its return until HFX_CT_NONE is clear) in ms."""
    t0 = time.monotonic()
    netns.run(argv, ns)
    t1 = time.monotonic()
    w = wait_for(lambda: not decided(), 2.0)
    return (t1 - t0) * 1000, None if w is None else w * 1000


def service() -> dict:
    return hf.service().get("new_flows") or {}


def ftp(path: str) -> str:
    """An active-FTP exchange from the sender to the receiver on path `path` ("hyb" or "plain"): the server's last
    answer ("226 ok": the data connection came through)."""
    server = {"hyb": "10.0.2.1", "plain": "10.1.2.1"}[path]
    me = {"hyb": "10.0.1.1", "plain": "10.1.1.1"}[path]
    return netns.run([sys.executable, "-c", CLIENT, server, me, "50021"], SEND, timeout=10).strip()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with hf.xdp_lab():
        f = tmp_path_factory.mktemp("cth") / "policy.rules"
        f.write_text(POLICY)
        hf("deploy", str(f), "--target", "xdp", "-q")
        netns.run(["iptables-restore"], PLAIN, input=POLICY)
        srv = netns.popen([sys.executable, "-u", "-c", SERVER], RECV, stdout=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "ready"
            hf.followed(timeout=30)
            yield f
        finally:
            srv.kill()
            netns.reap(srv)


def test_helper_rule_withdraws_and_restores(lab):
    """iptables-nft's CT helper rule (a raw-table base chain: also a foreign base chain, so the service shunts
    everything meanwhile) and iptables-legacy's (no nf_tables event: the service polls the legacy raw table):
    HFX_CT_NONE is withdrawn within a second, without `status` or a redeploy, and `status` shows no drift about it;
    with the legacy helper in force an FTP data connection (RELATED to the kernel, NEW to a lookup) completes through
    the hybrid as through the kernel alone; the rule removed, HFX_CT_NONE comes back."""
    assert wait_for(decided, 5.0) is not None, service()
    # through nf_tables: the event
    run_ms, lag_ms = change(["iptables", *HELPER])
    try:
        assert lag_ms is not None and lag_ms < 1000, service()
        print(f"iptables-nft helper rule: command {run_ms:.1f} ms, then withdrawn after {lag_ms:.1f} ms")
    finally:
        netns.run(["iptables", "-t", "raw", "-F"], FW)
        netns.run(["nft", "delete", "table", "ip", "raw"], FW)
    assert wait_for(decided, 5.0) is not None, service()
    hf.followed(timeout=30)
    # iptables-legacy: polled
    run_ms, lag_ms = change(["iptables-legacy", *HELPER])
    netns.run(["iptables-legacy", *HELPER], PLAIN)
    try:
        assert lag_ms is not None and lag_ms < 1000, service()
        print(f"iptables-legacy helper rule: command {run_ms:.1f} ms, then withdrawn after {lag_ms:.1f} ms")
        p = hf("status", "--json", check=False)
        assert not any("new flows" in d for d in json.loads(p.stdout)["drift"]), p.stdout[-2000:]
        # the kernel alone first, then the hybrid: the data connection is RELATED and accepted
        assert ftp("plain") == "226 ok"
        assert ftp("hyb") == "226 ok"
        assert not decided()
        # the legacy rule is withdrawn by the follower itself (no nf_tables event); iptables-nft's may have been
        # withdrawn by the policy sync's own follow of that foreign base chain first (its tables written with the
        # check's answer, under the deployment's lock), which the follower does not count (seen at load). The
        # check that names the rule is one begun after it: a check begun before may still report "" meanwhile.
        assert wait_for(lambda: service()["why_not"], 5.0, step=0.05) is not None, service()
        doc = service()
        assert doc["withdrawals"] >= 1 and doc["why_not"], doc
        print("service:", {k: doc[k] for k in ("withdrawals", "restores", "exp_events", "lag_withdraw_ms", "check_ms")})
    finally:
        netns.run(["iptables-legacy", "-t", "raw", "-F"], FW)
        netns.run(["iptables-legacy", "-t", "raw", "-F"], PLAIN)
    assert wait_for(decided, 5.0) is not None, service()
    p = hf("status", "--json", check=False)
    assert p.returncode == 0, p.stdout[-2000:]


# a SYN to a port the policy drops, sent the moment it is told (a process started ahead: no process start between)
SYN = r"""
import socket, sys
print("ready", flush=True)
for _ in sys.stdin:
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect(("10.0.2.1", 8081))
    except BlockingIOError:
        pass
    print("sent", flush=True)
    s.close()
"""


def counter(index: int) -> int:
    from hypafilter.targets.bpfmap import PinnedArray, percpu_sum

    st = json.loads((Path(STATE) / "state.json").read_text())
    with PinnedArray(Path(st["nic"]["pin"]) / "hfx_cnt") as m:
        return percpu_sum(m, index)


def granted() -> bool:
    """HFX_CT_NONE set and granted at the watcher's count now: the program reads a miss as ct 3."""
    from hypafilter.targets.xdp.newflows import Gate

    st = json.loads((Path(STATE) / "state.json").read_text())
    return decided() and Gate(st["nic"]["pin"], FW).current()


def test_legacy_rule_holds_at_once(lab):
    """The legacy raw table sends no event and is polled every 50 ms, but the host's watcher counts its replacement
    on setsockopt's entry: a new flow's SYN (to a port the policy drops, a conntrack miss) sent the instant
    `iptables-legacy -t raw ... -j CT --helper ftp` returns goes to the stack (forced, as any miss while a helper may
    make it RELATED), never dropped in XDP as NEW; three times (on main the poll lets nearly every one through XDP)."""
    snd = netns.popen([sys.executable, "-u", "-c", SYN], SEND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert snd.stdout.readline().strip() == "ready"
        for _ in range(3):
            assert wait_for(granted, 5.0) is not None, service()
            d0, p0 = counter(3), counter(0)  # HFX_CNT_DROPPED, HFX_CNT_PKTIN
            netns.run(["iptables-legacy", *HELPER], FW)
            snd.stdin.write("go\n")
            snd.stdin.flush()
            assert snd.stdout.readline().strip() == "sent"
            try:
                assert wait_for(lambda p0=p0: counter(0) > p0, 1.0) is not None, "the SYN did not reach the program"
                time.sleep(0.01)
                assert counter(3) == d0, "the SYN was dropped in XDP as NEW while the helper rule was in force"
            finally:
                netns.run(["iptables-legacy", "-t", "raw", "-F"], FW)
    finally:
        snd.kill()
        netns.reap(snd)


def test_expectation_withdraws_and_restores(lab):
    """An expectation created through ctnetlink (`conntrack -I expect`) on a control connection that got the ftp
    helper while a (legacy) CT rule was in force, the rule since removed: the EXP_NEW event withdraws HFX_CT_NONE;
    the expectation deleted, it comes back."""
    import socket

    from hypafilter.netns import inside

    netns.run(["iptables-legacy", *HELPER], FW)
    try:
        assert wait_for(lambda: not decided(), 2.0) is not None
        with inside(SEND):
            c = socket.create_connection(("10.0.2.1", 21), timeout=3)
        sport = c.getsockname()[1]
        assert wait_for(lambda: "helper=ftp" in netns.run(["conntrack", "-L"], FW), 2.0, 0.05) is not None
    finally:
        netns.run(["iptables-legacy", "-t", "raw", "-F"], FW)
    try:
        assert wait_for(decided, 5.0) is not None, service()  # the master keeps its helper, but no rule, no expectation
        before = service().get("exp_events", 0)
        expect = ["conntrack", "-I", "expect", "--orig-src", "10.0.1.1", "--orig-dst", "10.0.2.1", "-p", "tcp"]
        expect += ["--orig-port-src", str(sport), "--orig-port-dst", "21", "--tuple-src", "10.0.2.1"]
        expect += ["--tuple-dst", "10.0.1.1", "--tuple-port-src", "0", "--tuple-port-dst", "50022"]
        expect += ["--mask-src", "255.255.255.255", "--mask-dst", "255.255.255.255", "--mask-port-src", "0"]
        expect += ["--mask-port-dst", "65535", "-t", "60"]
        run_ms, lag_ms = change(expect)
        assert lag_ms is not None and lag_ms < 1000, service()
        print(f"conntrack -I expect: command {run_ms:.1f} ms, then withdrawn after {lag_ms:.1f} ms")
        assert wait_for(lambda: service().get("exp_events", 0) > before, 3.0, 0.05) is not None, service()
        assert "expectation" in (service().get("why_not") or "") or not decided()
        netns.run(["conntrack", "-D", "expect", "--orig-src", "10.0.1.1", "--orig-dst", "10.0.2.1", "-p", "tcp",
                   "--orig-port-src", str(sport), "--orig-port-dst", "21"], FW, check=False)  # fmt: skip
        netns.run(["conntrack", "-F", "expect"], FW, check=False)
        assert wait_for(decided, 5.0) is not None, (service(), netns.run(["conntrack", "-L", "expect"], FW))
    finally:
        c.close()


# ---- opt-in: the window, measured (`make newflows-lag`; docs/xdp.md "Following the configuration") -----------------

LAG_RUNS = int(os.environ.get("HF_NEWFLOWS_LAG", "0"))


def dropped() -> int:
    from hypafilter.targets.bpfmap import PinnedArray, percpu_sum

    st = json.loads((Path(STATE) / "state.json").read_text())
    with PinnedArray(Path(st["nic"]["pin"]) / "hfx_cnt") as m:
        return percpu_sum(m, 3)  # HFX_CNT_DROPPED


def opt_in(test):
    """The measurements below are defined only with HF_NEWFLOWS_LAG=N (`make newflows-lag`): `make test` neither
    runs nor lists them (as the other opt-in measurements: HF_XDP_LARGE, HF_XDP_V6_FULL)."""
    return test if LAG_RUNS else None


def _pcts(xs: list[float]) -> str:
    s = sorted(xs)
    return f"p50 {s[len(s) // 2]:.1f} ms, max {s[-1]:.1f} ms (n={len(s)})"


@opt_in
@pytest.mark.parametrize("kind", ("nft-object", "iptables-nft", "iptables-legacy", "expectation", "nft-rule"))
def test_withdraw_lag(lab, kind):
    """N times: the change made, then HFX_CT_NONE polled every 0.2 ms until it is clear: the time from the command's
    start and from its return, and the service's own (the cause read -> the map written); whether the program
    already held (the watcher's count moved past the grant) when the command returned; then undone, and the
    permission back before the next run. "nft-rule" is a rule that makes nothing RELATED (a counter in a table of its
    own): the time from its command's return until ct 3 is granted again (the check's, after the count moved)."""
    import socket

    from hypafilter.netns import inside

    add, undo = {
        "nft-object": (
            ["nft", 'add table ip cthx; add ct helper ip cthx h { type "ftp" protocol tcp; }'],
            [["nft", "delete", "table", "ip", "cthx"]],
        ),
        "iptables-nft": (["iptables", *HELPER], [["iptables", "-t", "raw", "-F"], ["nft", "delete table ip raw"]]),
        "iptables-legacy": (["iptables-legacy", *HELPER], [["iptables-legacy", "-t", "raw", "-F"]]),
        "nft-rule": (["nft", "add table ip cthr; add chain ip cthr c; add rule ip cthr c counter"], []),
    }.get(kind, (None, [["conntrack", "-F", "expect"]]))
    c = None
    if kind == "expectation":  # a master with the ftp helper, the rule gone
        netns.run(["iptables-legacy", *HELPER], FW)
        with inside(SEND):
            c = socket.create_connection(("10.0.2.1", 21), timeout=3)
        netns.run(["iptables-legacy", "-t", "raw", "-F"], FW)
        sport = c.getsockname()[1]
        add = ["conntrack", "-I", "expect", "--orig-src", "10.0.1.1", "--orig-dst", "10.0.2.1", "-p", "tcp"]
        add += ["--orig-port-src", str(sport), "--orig-port-dst", "21", "--tuple-src", "10.0.2.1"]
        add += ["--tuple-dst", "10.0.1.1", "--tuple-port-src", "0", "--tuple-port-dst", "50022"]
        add += ["--mask-src", "255.255.255.255", "--mask-dst", "255.255.255.255", "--mask-port-src", "0"]
        add += ["--mask-port-dst", "65535", "-t", "60"]
    from_start, from_return, back, held = [], [], [], 0
    try:
        for _ in range(LAG_RUNS):
            assert wait_for(granted, 5.0) is not None, service()
            time.sleep(0.1)
            t0 = time.monotonic()
            netns.run(add, FW)
            t1 = time.monotonic()
            held += not granted()
            w = wait_for(lambda: not decided(), 2.0, 0.0002)
            assert w is not None
            from_start.append((t1 - t0 + w) * 1000)
            from_return.append(w * 1000)
            if kind == "nft-rule":
                b = wait_for(granted, 2.0, 0.0002)
                assert b is not None, service()
                back.append((time.monotonic() - t1) * 1000)
                netns.run(["nft", "delete table ip cthr"], FW)
            for u in undo:
                netns.run(u, FW)
        time.sleep(1.1)  # the status file (every second)
        print(f"\n{kind}: command start -> withdrawn {_pcts(from_start)}; command return -> withdrawn "
              f"{_pcts(from_return)}; service (cause read -> written) {service()['lag_withdraw_ms']}; held at the "
              f"command's return {held} of {LAG_RUNS}" + (f"; return -> granted again {_pcts(back)}" if back else ""))  # fmt: skip
    finally:
        if c is not None:
            c.close()
    assert wait_for(decided, 5.0) is not None


@opt_in
@pytest.mark.parametrize("tool", ("iptables", "iptables-legacy"))
def test_ftp_right_after_the_rule(lab, tool):
    """The race itself, N times: the helper rule added and an active-FTP exchange started at once (the control
    connection, USER, PORT, the server's data connection: every step a round trip through the firewall): whether the
    data connection's first SYN was dropped in XDP (HFX_CNT_DROPPED moved: a frame the kernel would have accepted
    as RELATED, decided as NEW) or the exchange failed."""
    wrong, failed, slow = 0, 0, 0
    for _ in range(LAG_RUNS):
        assert wait_for(granted, 5.0) is not None, service()
        if tool == "iptables":
            hf.followed(timeout=30)
        time.sleep(0.1)
        d0 = dropped()
        client = netns.popen(
            [sys.executable, "-u", "-c", CLIENT, "10.0.2.1", "10.0.1.1", "50021", "wait"],
            SEND,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout.readline().strip() == "ready"
        netns.run([tool, *HELPER], FW)
        t0 = time.monotonic()
        client.stdin.write("go\n")
        client.stdin.flush()
        ok = client.stdout.readline().strip() == "226 ok"
        netns.reap(client)
        slow += time.monotonic() - t0 > 0.9  # a SYN retransmitted (1 s): one of its frames was lost
        wrong += dropped() != d0
        failed += not ok
        netns.run([tool, "-t", "raw", "-F"], FW)
        if tool == "iptables":
            netns.run(["nft", "delete table ip raw"], FW)
        netns.run(["conntrack", "-F", "expect"], FW, check=False)
    print(
        f"\n{tool}: {wrong} of {LAG_RUNS} exchanges had a frame dropped in XDP, {slow} took over 0.9 s, {failed} failed"
    )
    assert failed == 0

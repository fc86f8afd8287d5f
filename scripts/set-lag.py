#!/usr/bin/env python3
"""The lag from a ban to the xdp fast path dropping the banned source (docs/sets.md, "Following the kernel's sets").

In a lab of its own (HF_LAB, default "ips"; state in HF_STATE_DIR), with target xdp: the policy fail2ban's
iptables-ipset action would insert (`-p udp -m udp --dport 9 -m set --match-set f2b-lag src -j DROP`) beside a
blocklist of --blocklist hash:net networks, deployed with the sets from an `ipset save` file (fail2ban finds its rule
there, `iptables -C`, and inserts none). For each of --bans
addresses: a sender process streams UDP frames from it (AF_PACKET in the lab's sender namespace), the ban is made —
`ipset add f2b-lag IP` from a shell (--tool ipset) or `fail2ban-client set lag banip IP` against a fail2ban server
running the stock iptables-ipset action in the firewall namespace (--tool fail2ban) — and the XDP program's drop
counter is polled until it moves. Prints JSON (ms: p50, p90, max): the lag from the command's return (ipset) or from
the moment fail2ban's `ipset add` entered the kernel (the watcher's count for the namespace moved; fail2ban's actions
thread runs a ban up to a second after `banip` returned, which is fail2ban's own latency, reported apart) to the first
frame dropped in XDP.

    PYTHONPATH=mgmt .venv/bin/python scripts/set-lag.py --tool ipset --bans 20 --blocklist 10000

`--family 6`: the same with IPv6 (docs/sets.md "IPv6 sets"): `family inet6` sets (f2b-lag hash:ip, bl hash:net of
/64 networks), the ban rule and the blocklist in an ip6tables policy deployed beside an empty IPv4 one (`--ipv6`),
the sender streaming IPv6 UDP frames from fd48:4600::1:<100 + i> (--tool ipset only).

`--target emu`: the same on the emulated NIC (its lab, `--ipv6` a dual-stack core; the core's set tables followed by
the policy sync service's set follower, ops.policysync.nicsets), the drop counter the core's CNT_DROPPED (read over
the NIC's control socket, ~1 ms a poll) (--tool ipset only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "mgmt"))

LAB = os.environ.setdefault("HF_LAB", "ips")
STATE = os.environ.setdefault("HF_STATE_DIR", f"/run/hypafilter/test-{LAB}")
HF = [sys.executable, "-m", "hypafilter"]
CNT_DROPPED = 3  # hfx_cnt index (driver/xdp/hf_fastpath.h)

SENDER6 = r"""
import socket, struct, sys, time
src, dst = socket.inet_pton(socket.AF_INET6, sys.argv[1]), socket.inet_pton(socket.AF_INET6, "fd48:4600::2:1")
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("hyb0", 0))
udp = bytearray(struct.pack("!HHHH", 4000, 9, 16, 0) + b"x" * 8)
ph = src + dst + struct.pack("!IxxxB", len(udp), 17) + bytes(udp)
t = sum(struct.unpack(f"!{len(ph) // 2}H", ph))
while t >> 16:
    t = (t & 0xFFFF) + (t >> 16)
udp[6:8] = struct.pack("!H", ~t & 0xFFFF or 0xFFFF)
ip = struct.pack("!IHBB", 6 << 28, len(udp), 17, 64) + src + dst
frame = bytes.fromhex("0e48fffffffe" "024846000101" "86dd") + ip + bytes(udp)
while True:
    s.send(frame)
    time.sleep(0.00005)
"""

SENDER = r"""
import socket, struct, sys, time
src = bytes(int(x) for x in sys.argv[1].split("."))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("hyb0", 0))
def csum(b):
    t = sum(struct.unpack("!10H", b))
    t = (t & 0xFFFF) + (t >> 16)
    return ~((t & 0xFFFF) + (t >> 16)) & 0xFFFF
ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 36, 1, 0, 64, 17, 0, src, bytes([10, 0, 2, 1])))
ip[10:12] = struct.pack("!H", csum(bytes(ip)))
frame = bytes.fromhex("0e48fffffffe" "024846000101" "0800") + bytes(ip) + struct.pack("!HHHH", 4000, 9, 16, 0) + b"x" * 8
while True:
    s.send(frame)
    time.sleep(0.00005)
"""


def hf(*args: str) -> str:
    p = subprocess.run(
        HF + list(args), capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "mgmt"))
    )
    if p.returncode:
        raise SystemExit(f"hypafilter {' '.join(args)}: {p.stderr[-2000:]}")
    return p.stdout


def blocklist(n: int) -> list[str]:
    out, a = [], 0x2D000000
    for _ in range(n):
        out.append(f"add bl {a >> 24}.{a >> 16 & 255}.{a >> 8 & 255}.{a & 255}/24")
        a += 0x100
    return out


def blocklist6(n: int) -> list[str]:
    return [f"add bl 2001:db8:{i >> 16:x}:{i & 0xFFFF:x}::/64" for i in range(n)]


def f2b_config(d: Path) -> Path:
    """A fail2ban configuration of its own (the stock action and filter files, a jail `lag` with the stock
    iptables-ipset action on FORWARD, blocktype DROP, UDP port 9), its socket and state under `d`."""
    conf = d / "fail2ban"
    shutil.copytree("/etc/fail2ban", conf)
    for sub in ("jail.d", "fail2ban.d"):
        shutil.rmtree(conf / sub, ignore_errors=True)
        (conf / sub).mkdir()
    (conf / "fail2ban.local").write_text(
        f"[Definition]\nloglevel = INFO\nlogtarget = {d}/f2b.log\nsocket = {d}/f2b.sock\npidfile = {d}/f2b.pid\n"
        "dbfile = :memory:\n"
    )
    (d / "empty.log").write_text("")
    (conf / "jail.local").write_text(
        "[DEFAULT]\nbackend = polling\nbanaction = iptables-ipset\n\n[lag]\nenabled = true\nfilter = sshd\n"
        f"logpath = {d}/empty.log\nport = 9\nprotocol = udp\nchain = FORWARD\nblocktype = DROP\nbantime = 3600\n"
        "action = iptables-ipset[name=lag, port=9, protocol=udp, chain=FORWARD, blocktype=DROP]\n"
    )
    return conf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", choices=("ipset", "fail2ban"), default="ipset")
    ap.add_argument("--bans", type=int, default=20)
    ap.add_argument("--blocklist", type=int, default=10000, help="networks in the blocklist set beside f2b-lag")
    ap.add_argument("--keep", action="store_true", help="leave the lab up")
    ap.add_argument("--family", type=int, choices=(4, 6), default=4, help="6: inet6 sets in an ip6tables policy")
    ap.add_argument("--target", choices=("xdp", "emu"), default="xdp")
    args = ap.parse_args()
    if (args.family == 6 or args.target == "emu") and args.tool != "ipset":
        raise SystemExit("--family 6 and --target emu measure `ipset add` (--tool ipset)")
    emu = args.target == "emu"
    from hypafilter import netns
    from hypafilter.ops import deploy
    from hypafilter.targets.bpfmap import PinnedArray, percpu_sum
    from hypafilter.targets.xdp.sets import SetMaps, slots_of
    from hypafilter.targets.xdp.target import _shape_of

    fw, snd = f"{LAB}-fw", f"{LAB}-send"
    work = Path(tempfile.mkdtemp(prefix="set-lag-"))
    hf("lab", "up", *([] if emu else ["--target", "xdp"]), "--name", LAB)
    fam = "inet6" if args.family == 6 else "inet"
    (work / "sets.save").write_text(
        "\n".join(
            [
                f"create f2b-lag hash:ip family {fam} hashsize 1024 maxelem 65536 timeout 0",
                f"create bl hash:net family {fam} hashsize 4096 maxelem 65536",
                *(blocklist(args.blocklist) if args.family == 4 else blocklist6(args.blocklist)),
            ]
        )
        + "\n"
    )
    rules = (
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
        "-A FORWARD -p udp -m udp --dport 9 -m set --match-set f2b-lag src -j DROP\n"
        "-A FORWARD -m set --match-set bl src -j DROP\nCOMMIT\n"
    )
    if args.family == 6:
        (work / "p.rules").write_text(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"
        )
        (work / "p6.rules").write_text(rules)
        six = ["--ipv6", str(work / "p6.rules"), "--allow-empty"]
    else:
        (work / "p.rules").write_text(rules)
        six = []
    hf("deploy", str(work / "p.rules"), *six, "--ipsets", str(work / "sets.save"), "--target", args.target)
    server = None
    client: list[str] = []
    if args.tool == "fail2ban":
        conf = f2b_config(work)
        server = subprocess.Popen(
            ["ip", "netns", "exec", fw, "fail2ban-server", "-f", "-x", "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = ["ip", "netns", "exec", fw, "fail2ban-client", "-c", str(conf)]
        for _ in range(100):
            if subprocess.run([*client, "ping"], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        time.sleep(1.0)
    st = deploy.read_state(Path(STATE) / "state.json")
    stack = contextlib.ExitStack()
    if emu:
        from hypafilter.targets.emu.target import EmuTarget

        nic = stack.enter_context(EmuTarget(deploy.deployed_config(st)).client(st["nic"]))

        def dropped() -> int:
            return nic.read("CNT_DROPPED")

        sm = None
    else:
        cnt = PinnedArray(Path(st["nic"]["pin"]) / "hfx_cnt")

        def dropped() -> int:
            return percpu_sum(cnt, CNT_DROPPED)

        sm = SetMaps(st["nic"]["pin"], slots_of(_shape_of(st["nic"])), fw)  # the watcher's counts of the namespace
    lags, lags_call, tool_lags = [], [], []
    try:
        for i in range(args.bans):
            src = f"10.0.1.{100 + i}" if args.family == 4 else f"fd48:4600::1:{100 + i:x}"
            code = SENDER if args.family == 4 else SENDER6
            sender = subprocess.Popen(["ip", "netns", "exec", snd, sys.executable, "-c", code, src])
            time.sleep(0.3)
            d0 = dropped()
            c0 = sm.counts()[0] if sm is not None else 0
            t_call = time.monotonic()
            if args.tool == "ipset":
                netns.run(["ipset", "add", "f2b-lag", src], fw)
            else:
                subprocess.run([*client, "set", "lag", "banip", src], check=True, capture_output=True)
            t_ret = time.monotonic()
            t_drop = t_seen = None
            while time.monotonic() - t_ret < 5.0:
                if t_seen is None and sm is not None and sm.counts()[0] != c0:
                    t_seen = time.monotonic()
                if dropped() > d0:
                    t_drop = time.monotonic()
                    break
                time.sleep(0.0001)
            sender.kill()
            sender.wait()
            if t_drop is None:
                print(f"ban {src}: no frame dropped in the fast path within 5 s", file=sys.stderr)
                continue
            if args.tool == "ipset":
                lags.append((t_drop - t_ret) * 1e3)
            else:
                lags.append((t_drop - (t_seen or t_ret)) * 1e3)
                tool_lags.append(((t_seen or t_drop) - t_call) * 1e3)
            lags_call.append((t_drop - t_call) * 1e3)
            time.sleep(0.2)
    finally:
        stack.close()
        if server is not None:
            subprocess.run([*client, "stop"], capture_output=True)
            server.wait(timeout=10)
        if not args.keep:
            hf("undeploy", "-q")
            hf("lab", "down", "--name", LAB)
        shutil.rmtree(work, ignore_errors=True)

    def pct(xs: list[float]) -> dict:
        s = sorted(xs)
        if not s:
            return {"n": 0}
        return {
            "n": len(s),
            "p50": round(s[len(s) // 2], 1),
            "p90": round(s[min(len(s) - 1, int(len(s) * 0.9))], 1),
            "max": round(s[-1], 1),
        }

    print(
        json.dumps(
            {
                "tool": args.tool,
                "family": args.family,
                "target": args.target,
                "blocklist": args.blocklist,
                ("lag_from_return_ms" if args.tool == "ipset" else "lag_from_kernel_command_ms"): pct(lags),
                "lag_from_start_ms": pct(lags_call),
                **({"fail2ban_banip_to_kernel_command_ms": pct(tool_lags)} if tool_lags else {}),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

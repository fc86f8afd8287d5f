"""Real tools edit the live ruleset (issue #23, "Real tools, the kernel as oracle"): a fail2ban-server, ufw and a
DOCKER-USER chain, each confined to the lab's firewall namespace, ban the lab's sender; the ban holds on the hybrid
path exactly as on the live ruleset alone (`verify --live`: 0 mismatches; the sender's datagrams not delivered)
and lifts when the tool removes it. The policy sync service carries every change to the fast path
(docs/deploy.md, "Live policy")."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypafilter import netns
from hypafilter.ops.connections import udp_delivered
from hypafilter.ops.lab import Lab

from conftest import ROOT, TEST_FULL, need_root, need_tool
from tests.hfcli import HfCli

pytestmark = pytest.mark.system

LAB = "tlt"
STATE = f"/run/hypafilter/test-{LAB}"
FW = f"{LAB}-fw"
SENDER = Lab.ip("send")  # the address the lab's sender sends from on the hybrid path (and the one banned)
RECEIVER = Lab.ip("recv")
JAIL_PORT, OTHER_PORT = 53, 9999  # example.rules accepts both from the sender to the receiver
BOTH = [(JAIL_PORT, b"query"), (OTHER_PORT, b"other")]
hf = HfCli(LAB, STATE)


@pytest.fixture(scope="module", params=[pytest.param("emu", marks=TEST_FULL), "xdp"])
def lab(request) -> Iterator[str]:
    need_root()
    need_tool("ip", "iptables-restore", "fail2ban-server", "fail2ban-client", "ufw", "unshare", "mount")
    target = request.param
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(STATE, ignore_errors=True)
    hf("lab", "up", "--name", LAB, *(["--target", "xdp"] if target == "xdp" else []))
    yield target
    hf("undeploy", "-q", check=False)
    hf("lab", "down", "--name", LAB, check=False)
    shutil.rmtree(STATE, ignore_errors=True)


def example(target: str) -> None:
    """example.rules deployed (nothing happens when it is already)."""
    hf("deploy", str(ROOT / "rulesets" / "example.rules"), "--target", target, "-q")


def ipt(*args: str) -> str:
    return netns.run(["iptables", "-w", *args], FW)


def delivered(sends=BOTH) -> list[int]:
    """The ports of `sends` whose datagram from the sender reached the receiver on the hybrid path."""
    return [p for p, _ in udp_delivered(f"{LAB}-send", f"{LAB}-recv", RECEIVER, sends, wait=0.5)]


def until(what: str, cond: Callable[[], bool], timeout: float = 30.0, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(every)


def holds(decides: bool = True) -> dict:
    """The deployment follows the live ruleset, and `verify --live` finds no frame judged otherwise than by the
    live ruleset alone; `decides`: the fast path still decided some of them itself."""
    hf.followed()
    r = hf.verify_live()
    if decides:
        assert r["hw_forwarded"] + r["hw_dropped"] > 0, r
    return r


def jump_first(chain: str) -> list[str]:
    """FORWARD as iptables lists it, checked to hold the tool's jump first and then the jump to `chain`."""
    forward = ipt("-S", "FORWARD").splitlines()
    assert forward[1].startswith("-A FORWARD -j HF") and forward[2].endswith(f"-j {chain}"), forward
    return forward


# ---- fail2ban -------------------------------------------------------------------------------------------------------

JAIL = "tlt"


class Fail2ban:
    """A fail2ban-server of its own (configuration, socket, pid file, log, an in-memory database, all under `dir`)
    run inside the firewall namespace, with one jail: a log file it polls (no pyinotify), a filter of one regex, and
    Debian's own iptables-multiport action on FORWARD for udp/JAIL_PORT. Its iptables commands run where it runs."""

    def __init__(self, dir: Path):
        self.dir = dir
        self.log = dir / "app.log"
        conf = dir / "conf"
        (conf / "action.d").mkdir(parents=True)
        (conf / "filter.d").mkdir()
        for name in ("iptables.conf", "iptables-multiport.conf"):  # the package's actions, unchanged
            shutil.copy(Path("/etc/fail2ban/action.d") / name, conf / "action.d" / name)
        (conf / "fail2ban.conf").write_text(
            f"[Definition]\nloglevel = INFO\nlogtarget = {dir / 'fail2ban.log'}\nsyslogsocket = auto\n"
            f"socket = {dir / 'f2b.sock'}\npidfile = {dir / 'f2b.pid'}\ndbfile = :memory:\ndbpurgeage = 1d\n"
            "allowipv6 = auto\n"
        )
        (conf / "filter.d" / "tlt.conf").write_text(
            "[Definition]\nfailregex = ^tlt: bad request from <HOST>$\ndatepattern = {NONE}\n"
        )
        (conf / "jail.conf").write_text(
            f"[{JAIL}]\nenabled = true\nbackend = polling\nlogpath = {self.log}\nfilter = tlt\nmaxretry = 2\n"
            f"findtime = 600\nbantime = 1d\n"
            f"action = iptables-multiport[name={JAIL}, chain=FORWARD, port={JAIL_PORT}, protocol=udp]\n"
        )
        self.conf = conf
        self.log.write_text("")
        self.server: subprocess.Popen | None = None

    def client(self, *args: str) -> str:
        p = subprocess.run(["fail2ban-client", "-c", str(self.conf), *args], capture_output=True, text=True)
        assert p.returncode == 0, f"fail2ban-client {' '.join(args)}: {p.stdout}{p.stderr}"
        return p.stdout

    def __enter__(self) -> Fail2ban:
        out = open(self.dir / "server.out", "w")
        self.server = netns.popen(
            ["fail2ban-server", "-f", "-x", "-c", str(self.conf)], FW, stdout=out, stderr=subprocess.STDOUT
        )
        out.close()

        def started() -> bool:
            assert self.server.poll() is None, (self.dir / "server.out").read_text()
            return (
                subprocess.run(
                    ["fail2ban-client", "-c", str(self.conf), "status", JAIL], capture_output=True
                ).returncode
                == 0
            )

        try:
            until("fail2ban-server up with its jail", started)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """`fail2ban-client stop`: the jail's actionstop removes its chain and jump; the server exits."""
        if self.server.poll() is None:
            subprocess.run(["fail2ban-client", "-c", str(self.conf), "stop"], capture_output=True)
            try:
                self.server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()

    def fail(self, host: str, times: int) -> None:
        """`times` log lines its filter takes for a failure of `host`."""
        with self.log.open("a") as f:
            f.writelines(f"tlt: bad request from {host}\n" for _ in range(times))


def banned() -> bool:
    """The jail's chain holds the ban of the sender (the chain exists from the first ban on)."""
    rule = f"-A f2b-{JAIL} -s {SENDER}/32 -j REJECT --reject-with icmp-port-unreachable"
    return rule in netns.run(["iptables", "-w", "-S", f"f2b-{JAIL}"], FW, check=False).splitlines()


def test_fail2ban_ban_holds_on_the_hybrid_path_and_lifts(lab, tmp_path):
    example(lab)
    assert delivered() == [JAIL_PORT, OTHER_PORT]
    applied = hf.service()["applied"]
    with Fail2ban(tmp_path) as f2b:
        f2b.fail(SENDER, 3)  # maxretry 2: banned
        until("fail2ban banned the sender", banned)
        doc = hf.followed()
        assert doc["applied"] > applied and doc["lag_safe_ms"]["n"] >= 1
        holds()
        jump_first(f"f2b-{JAIL}")  # fail2ban inserted its jump at the top; the service put the tool's back first
        assert delivered() == [OTHER_PORT]  # the jail bans its port only
        assert SENDER in f2b.client("status", JAIL)

        f2b.client("unban", SENDER)
        until("fail2ban lifted the ban", lambda: not banned())
        holds()
        assert delivered() == [JAIL_PORT, OTHER_PORT]
    # stopped: its chain and jump are gone, and followed
    assert f"f2b-{JAIL}" not in ipt("-S")
    holds()
    doc = hf.service()
    print(f"fail2ban ({lab}): fail safe {doc['lag_safe_ms']} ms, applied {doc['lag_apply_ms']} ms")


# ---- DOCKER-USER ----------------------------------------------------------------------------------------------------


def test_docker_user_insert_holds_on_the_hybrid_path_and_lifts(lab):
    example(lab)
    # what Docker sets up: its user chain, returning, jumped to from the top of FORWARD
    ipt("-N", "DOCKER-USER")
    ipt("-A", "DOCKER-USER", "-j", "RETURN")
    ipt("-I", "FORWARD", "-j", "DOCKER-USER")
    holds()
    jump_first("DOCKER-USER")
    assert delivered() == [JAIL_PORT, OTHER_PORT]

    ipt("-I", "DOCKER-USER", "-s", f"{SENDER}/32", "-j", "DROP")
    holds()
    assert delivered() == []

    ipt("-D", "DOCKER-USER", "-s", f"{SENDER}/32", "-j", "DROP")
    holds()
    assert delivered() == [JAIL_PORT, OTHER_PORT]
    ipt("-D", "FORWARD", "-j", "DOCKER-USER")
    ipt("-F", "DOCKER-USER")
    ipt("-X", "DOCKER-USER")
    holds()


# ---- ufw ------------------------------------------------------------------------------------------------------------

UFW_FILES = ("/etc/ufw", "/lib/ufw", "/etc/default/ufw")  # what ufw reads and writes (its lock too, with TESTSTATE)


def tree_digest(paths) -> str:
    h = hashlib.sha256()
    for top in map(Path, paths):
        for p in sorted([top, *top.rglob("*")] if top.is_dir() else [top]):
            h.update(str(p).encode())
            if p.is_file():
                h.update(p.read_bytes())
    return h.hexdigest()


class Ufw:
    """ufw confined to the firewall namespace: `ip netns exec` changes only the network namespace, and ufw's
    files are the host's, so each command runs in a private mount namespace (`unshare --mount`) where copies of
    UFW_FILES under `dir` are bound over the originals; TESTSTATE puts its lock there too (else /run/ufw.lock)."""

    def __init__(self, dir: Path):
        self.dir = dir
        self.binds = []
        for i, src in enumerate(UFW_FILES):
            copy = dir / f"ufw{i}"
            (shutil.copytree if Path(src).is_dir() else shutil.copy2)(src, copy)
            self.binds.append((copy, src))
        # the lab's namespaces have IPv6 off: ufw's IPv6 half would load rules no frame meets
        default = dir / f"ufw{UFW_FILES.index('/etc/default/ufw')}"
        default.write_text(default.read_text().replace("IPV6=yes", "IPV6=no"))

    def __call__(self, *args: str) -> str:
        mounts = "".join(f'mount --bind "{c}" "{o}" && ' for c, o in self.binds)
        script = f'{mounts}TESTSTATE=1 exec ip netns exec {FW} ufw "$@"'
        p = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "ufw", *args],
            capture_output=True,
            text=True,
        )
        assert p.returncode == 0, f"ufw {' '.join(args)}: {p.stdout}{p.stderr}"
        return p.stdout


def test_ufw_route_deny_holds_on_the_hybrid_path_and_lifts(lab, tmp_path):
    host_files, host_lock = tree_digest(UFW_FILES), Path("/run/ufw.lock").exists()
    host_rules = netns.run(["iptables-save", "-t", "filter"])
    # ufw manages the whole table: the firewall starts empty, as a host before `ufw enable`
    hf("undeploy", "-q")
    netns.run(["iptables-restore", "-w"], FW, input="*filter\n:INPUT ACCEPT\n:FORWARD ACCEPT\n:OUTPUT ACCEPT\nCOMMIT\n")
    ufw = Ufw(tmp_path)
    ufw("--force", "enable")
    for port in (JAIL_PORT, OTHER_PORT):
        ufw("route", "allow", "proto", "udp", "to", f"{Lab.ip('recv')}/32", "port", str(port))
    policy = tmp_path / "ufw.rules"
    policy.write_text(netns.run(["iptables-save", "-t", "filter"], FW))
    assert ":ufw-user-forward" in policy.read_text()
    hf("deploy", str(policy), "--target", lab, "-q")
    # ufw's forward chains read conntrack (ESTABLISHED first): in bridge mode the fast path decides only the flows
    # its flow cache holds, and verify's single frames are all shunted (analysis.plan.miss_shunt_for)
    holds(decides=False)
    assert delivered() == [JAIL_PORT, OTHER_PORT]

    applied = hf.service()["applied"]
    ufw("route", "insert", "1", "deny", "from", SENDER)  # route rules are FORWARD rules: ufw-user-forward
    # while the change is read and applied (here a new core: seconds), `policysync status` says the fail safe is
    # in force (it used to show the previous change's "safe": false until the apply ended)
    until(
        "policysync status: the fail safe in force, the change not applied yet",
        lambda: (doc := hf.service())["safe"] and doc["applied"] == applied,
        timeout=10,
        every=0.01,
    )
    assert ipt("-S", "ufw-user-forward").splitlines()[1] == f"-A ufw-user-forward -s {SENDER}/32 -j DROP"
    holds(decides=False)
    assert delivered() == []

    ufw("route", "delete", "deny", "from", SENDER)
    holds(decides=False)
    assert delivered() == [JAIL_PORT, OTHER_PORT]
    doc = hf.service()
    print(f"ufw ({lab}): fail safe {doc['lag_safe_ms']} ms, applied {doc['lag_apply_ms']} ms ({doc['last_kind']})")
    # ufw touched nothing of the host: its files and the host namespace's ruleset are as they were
    assert tree_digest(UFW_FILES) == host_files and Path("/run/ufw.lock").exists() == host_lock
    assert ("ufw-" in netns.run(["iptables-save", "-t", "filter"])) == ("ufw-" in host_rules)

"""System test of the lab topology: idempotent up/down, exactly its own namespaces, working plain path (real TCP)."""

from __future__ import annotations

import subprocess

import pytest
from hypafilter import netns
from hypafilter.ops.lab import ADDRS6, ROLES, Lab

from conftest import ROOT, need_root, need_tool

pytestmark = pytest.mark.system

NAME = "hftl"
BYSTANDER = "hftl_bystander"


def cli(*args: str, status: int = 0) -> subprocess.CompletedProcess:
    """`hypafilter lab ...` as an operator runs it, expected to exit with `status`."""
    p = subprocess.run([str(ROOT / ".venv" / "bin" / "hypafilter"), "lab", *args], capture_output=True, text=True)
    assert p.returncode == status, f"lab {' '.join(args)}: exit {p.returncode}, {p.stderr}"
    return p


@pytest.fixture(scope="module")
def lab():
    need_root()
    need_tool("ip", "ethtool", "sysctl")
    lab = Lab(NAME)
    lab.down()
    if not netns.exists(BYSTANDER):
        netns.add(BYSTANDER)
    yield lab
    lab.down()
    netns.delete(BYSTANDER)


def test_up_is_idempotent_and_complete(lab):
    lab.up()
    first = lab.status()
    lab.up()
    second = lab.status()
    assert first["complete"] and second["complete"]

    # Link state may still settle between the calls; everything the lab configures must be identical.
    def shape(st):
        return {
            ns: {i: {k: v for k, v in d.items() if k != "state"} for i, d in ls.items()}
            for ns, ls in st["namespaces"].items()
        }

    assert shape(first) == shape(second)
    assert sorted(first["namespaces"]) == sorted(lab.ns(r) for r in ROLES)
    fw = second["namespaces"][lab.ns_fw]
    assert fw["nf0"]["master"] == "br0" and fw["nf1"]["master"] == "br0"
    assert fw["nf0"]["mtu"] >= 1514 + 10  # room for the in-band tag
    # IPv6 (docs/ipv6.md): the endpoints' static addresses (and lo's ::1) and nothing else, no link-local address
    # anywhere (nothing the lab's stacks would send on their own)
    want6 = {(lab.ns(a.role), a.ifname): [a.cidr.split("/")[0]] for a in ADDRS6}
    for ns, links in second["namespaces"].items():
        for ifname, info in links.items():
            loop = ["::1"] if ifname == "lo" and ns in (lab.ns_send, lab.ns_recv) else []
            assert info["ipv6"] == want6.get((ns, ifname), loop), f"{ns} {ifname} has IPv6 addresses {info['ipv6']}"
            if ifname != "lo":
                assert info["state"] in ("UP", "UNKNOWN"), f"{ifname} is {info['state']}"
    assert second["namespaces"][lab.ns_send]["hyb0"]["ipv4"] == ["10.0.1.1/16"]
    for role in ("fw", "plain"):
        out = lab.exec_in(role, ["sysctl", "-n", "net.bridge.bridge-nf-call-iptables"]).strip()
        assert out == "1"
    feats = lab.exec_in("send", ["ethtool", "-k", "hyb0"])
    for feat in ("generic-receive-offload", "generic-segmentation-offload", "tx-checksumming"):
        assert f"{feat}: off" in feats


def test_repairs_a_missing_link(lab):
    lab.up()
    netns.run(["ip", "-n", lab.ns_fw, "link", "del", "nf1"])  # removes host1 in the nic namespace too
    assert not lab.status()["complete"]
    lab.up()
    st = lab.status()
    assert st["complete"]
    assert st["namespaces"][lab.ns_fw]["nf1"]["master"] == "br0"


def test_plain_path_carries_tcp(lab):
    """A real TCP exchange sender → plain bridge → receiver (the oracle path)."""
    lab.up()
    server = lab.popen_in(
        "recv",
        [
            "python3",
            "-c",
            "import socket;s=socket.create_server(('10.1.2.1',5001));c,_=s.accept();c.sendall(c.recv(100)[::-1])",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        client = lab.exec_in(
            "send",
            [
                "python3",
                "-c",
                "import socket,time\n"
                "for _ in range(50):\n"
                "    try:\n"
                "        c=socket.create_connection(('10.1.2.1',5001),timeout=2);break\n"
                "    except OSError: time.sleep(0.1)\n"
                "c.sendall(b'hypafilter');print(c.recv(100).decode())",
            ],
            timeout=30,
        )
        assert client.strip() == "retlifapyh"
    finally:
        server.kill()
        server.wait()


def test_down_removes_only_its_own(lab):
    lab.up()
    removed = lab.down()
    assert len(removed) == 5
    names = netns.names()
    assert all(lab.ns(r) not in names for r in ROLES)
    assert BYSTANDER in names
    assert lab.down() == []  # idempotent


def test_cli(lab):
    cli("status", "--name", NAME, status=1)
    assert "up" in cli("up", "--name", NAME).stdout
    assert "complete" in cli("status", "--name", NAME).stdout
    assert "removed" in cli("down", "--name", NAME).stdout
    assert "nothing to remove" in cli("down", "--name", NAME).stdout
    assert "lab name" in cli("up", "--name", "no/slash", status=2).stderr

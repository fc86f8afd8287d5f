"""The attack mix of `bench rate --attack` (tools/bench/attack.py): the blocklist's networks and how it is expressed
(an ipset or plain rules, ahead of the policy, on every path), the attack frames' two parts, and the legitimate
connections the bench picks."""

from __future__ import annotations

import ipaddress

import pytest
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.hw.model import parse_frame
from hypafilter.iptables.document import parse_policy
from hypafilter.tools.bench import attack
from hypafilter.tools.bench.rate import attack_probes, attacker_pool, nft_text

POLICY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 8080 -j ACCEPT
-A FORWARD -p udp -m udp --dport 5353 -j ACCEPT
-A FORWARD -p tcp -m tcp --dport 22 -j DROP
COMMIT
"""
# A ClassBench import's shape: UDP accepted between two prefixes, conntrack first.
UDP_ONLY = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -s 61.0.0.0/8 -d 93.184.0.0/16 -p udp -m udp --dport 1000:2000 -j ACCEPT
COMMIT
"""


def _nets(networks):
    return [ipaddress.ip_network(attack.net_text(n)) for n in networks]


def test_blocklist_networks_disjoint_and_clear_of_the_avoided():
    avoid = {int(ipaddress.ip_address("61.2.3.4")), int(ipaddress.ip_address("93.184.1.1"))}
    nets = attack.blocklist_networks(3000, 1, avoid)
    assert len(nets) == len(set(nets)) == 3000
    assert attack.blocklist_networks(3000, 1, avoid) == nets  # the seed gives the same list
    objs = _nets(nets)
    assert {n.prefixlen for n in objs} == {16, 20, 22, 24, 32}
    ordered = sorted(objs, key=lambda n: int(n.network_address))
    assert all(not a.overlaps(b) for a, b in zip(ordered, ordered[1:], strict=False))
    for n in objs:
        first = int(n.network_address) >> 24
        assert first not in (0, 10, 127) and first < 224, n
        assert not any(ipaddress.ip_address(a) in n for a in avoid)
        assert not any(a >> 16 == int(n.network_address) >> 16 for a in avoid)
    with pytest.raises(HypafilterError, match="--blocklist"):
        attack.blocklist_networks(-1, 1)


def test_ipset_restore_text():
    nets = [(0x01020300, 24), (0x05060708, 32)]
    assert attack.ipset_restore(nets, "x").splitlines() == [
        "create x hash:net family inet hashsize 16384 maxelem 65536",
        "add x 1.2.3.0/24",
        "add x 5.6.7.8/32",
    ]


@pytest.mark.parametrize("target", ["emu", "xdp"])
def test_blocklist_set_fits_a_set_slot(target):
    """The bench's blocklist set, at its largest, is a set slot on each target with set tables: its rule a simple
    one (a maxelem above the target's slot makes it complex, and then every frame of the mix is shunted)."""
    from hypafilter.iptables.sets import SetEnv
    from hypafilter.netfilter.ipset import parse_save
    from hypafilter.targets import set_capability

    nets = attack.blocklist_networks(attack.MAX_BLOCKLIST, 3)
    text = attack.ipset_restore(nets)
    slots, capacity = set_capability(target)
    env = SetEnv(parse_save(text, "bench"), slots, capacity, target, "bench", text=text)
    rules = attack.blocklist_rules(nets, "ipset", "FORWARD")
    doc = "*filter\n:FORWARD DROP [0:0]\n" + "\n".join(rules) + "\n-A FORWARD -p udp -j ACCEPT\nCOMMIT\n"
    pol = parse_policy(doc, "p", config=Config(target=target), sets=env)
    assert not pol.rules[0].complex, pol.rules[0]
    assert len(pol.set_slots) == 1


@pytest.mark.parametrize("as_", attack.BLOCKLIST_AS)
def test_blocklist_goes_ahead_of_the_policy(as_):
    cfg = Config()
    pol = parse_policy(POLICY, "p")
    nets = attack.blocklist_networks(50, 2)
    both = attack.with_blocklist(pol, cfg, nets, as_)
    extra = 1 if as_ == "ipset" else 50
    assert len(both.original_rules) == len(pol.original_rules) + extra
    assert both.original_rules[extra:] == pol.original_rules
    first = " ".join(both.original_rules[0])
    if as_ == "ipset":
        assert first == f"-m set --match-set {attack.BLOCKLIST_SET} src -j DROP"
        assert both.rules[0].complex  # a set match is complex until sets are fast-path dimensions
    else:
        assert first == f"-s {attack.net_text(nets[0])} -j DROP"
    assert attack.with_blocklist(pol, cfg, [], as_) is pol
    with pytest.raises(HypafilterError, match="--blocklist-as"):
        attack.with_blocklist(pol, cfg, nets, "bpf")


def test_nft_text_blocklist_set():
    pol = parse_policy(POLICY, "p")
    text = nft_text(pol, Config(), [(0x01020300, 24), (0x05060708, 32)])
    assert f"set {attack.NFT_SET} {{" in text and "elements = { 1.2.3.0/24, 5.6.7.8/32 }" in text
    hook = text[text.index("type filter hook forward") :]
    assert hook.index(f"ip saddr @{attack.NFT_SET} drop") < hook.index("jump ")


def test_attack_mix_parts():
    cfg = Config()
    pol = parse_policy(POLICY, "p")
    pool = attacker_pool(3, 20)
    nets = attack.blocklist_networks(100, 3, set(pool))
    probes = attack_probes(pol, cfg, None, 400, 3, "syn", 20, nets, 0.25)
    kinds = [p.kind for p in probes]
    assert kinds == ["attack_syn"] * 300 + ["blocklist_syn"] * 100
    objs = _nets(nets)
    for p in probes:
        h = parse_frame(p.frame, 0x01)
        assert h.proto == 6 and h.tcp_flags == 0x02
        listed = any(ipaddress.ip_address(h.src) in n for n in objs)
        assert listed == (p.kind == "blocklist_syn")
        if p.kind == "attack_syn":
            assert h.src in pool
    # no blocklist: every frame from the pool, as before the blocklist existed
    assert [p.frame for p in attack_probes(pol, cfg, None, 50, 3, "syn", 20)] == [
        p.frame for p in attack_probes(pol, cfg, None, 50, 3, "syn", 20, [], 0.5)
    ]


def _headers(text):
    import random

    from hypafilter.ops.verify import FrameGen

    rng = random.Random(5)
    gen = FrameGen(parse_policy(text, "p"), rng)
    return [gen.header() for _ in range(5000)]


def test_legit_flow_tcp_where_accepted_else_udp():
    cfg = Config()
    f = attack.legit_flow(parse_policy(POLICY, "p"), cfg, _headers(POLICY), 10, 1)
    assert (f.proto, f.port, len(set(f.sports))) == ("tcp", 8080, 10)
    f = attack.legit_flow(parse_policy(UDP_ONLY, "p"), cfg, _headers(UDP_ONLY), 10, 1)
    assert f.proto == "udp" and 1000 <= f.port <= 2000 and len(set(f.sports)) == 10
    assert ipaddress.ip_address(f.client) in ipaddress.ip_network("61.0.0.0/8")
    assert ipaddress.ip_address(f.server) in ipaddress.ip_network("93.184.0.0/16")
    forced = attack.legit_flow(parse_policy(POLICY, "p"), cfg, _headers(POLICY), 3, 1, ("udp", 9090))
    assert (forced.proto, forced.port, forced.sports) == ("udp", 9090, (40000, 40001, 40002))


def test_legit_flow_refused_where_nothing_is_accepted():
    drop_all = "*filter\n:FORWARD DROP [0:0]\n-A FORWARD -p tcp -m tcp --dport 22 -j DROP\nCOMMIT\n"
    with pytest.raises(HypafilterError, match="--legit PROTO:PORT"):
        attack.legit_flow(parse_policy(drop_all, "p"), Config(), _headers(drop_all), 5, 1)


@pytest.mark.parametrize("text", ["tcp", "icmp:1", "udp:0", "tcp:70000", "tcp:x"])
def test_parse_legit_refuses(text):
    with pytest.raises(HypafilterError, match="--legit"):
        attack.parse_legit(text)


def test_parse_legit():
    assert attack.parse_legit("udp:53") == ("udp", 53) and attack.parse_legit(None) is None


def test_legit_window_is_time_of_the_measured_rate():
    # 600 frames/s: 0.25 s of it; a fast emulator capped at --window; a slow one at the floor; 0 s: --window
    assert attack.legit_window(2048, 20000, 20000 / 600, 0.25) == 150
    assert attack.legit_window(2048, 20000, 0.5, 0.25) == 2048
    assert attack.legit_window(2048, 20000, 2000.0, 0.25) == attack.LEGIT_WINDOW_MIN
    assert attack.legit_window(2048, 20000, 20000 / 600, 0) == 2048
    assert attack.legit_window(32, 20000, 2000.0, 0.25) == 32


def test_udp_flow_backs_off_while_unanswered(monkeypatch):
    """A UDP flow that gets no answer resends its datagrams after UDP_RETRY, then after twice that, ... (RFC 8085
    section 3.1), instead of every UDP_RETRY: a queue longer than UDP_RETRY ahead of the path must not multiply the
    datagrams. The time scaled down tenfold: resends at 0.1 and 0.3 s, the next (0.7 s) after the 0.45 s of quiet."""
    import socket
    import threading

    monkeypatch.setattr(attack, "UDP_RETRY", 0.1)
    monkeypatch.setattr(attack, "UDP_RETRY_MAX", 0.4)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    got: list[bytes] = []
    done = threading.Event()

    def count() -> None:
        sink.settimeout(0.05)
        while not done.is_set():
            try:
                got.append(sink.recv(65536))
            except TimeoutError:
                pass

    t = threading.Thread(target=count)
    t.start()
    flow = attack.LegitFlow(
        "udp",
        int(ipaddress.ip_address("127.0.0.1")),
        int(ipaddress.ip_address("127.0.0.1")),
        sink.getsockname()[1],
        (0,),
    )
    try:
        res = attack._udp(None, flow, 0, 0.45)
    finally:
        done.set()
        t.join()
        sink.close()
    grams = attack.LEGIT_BYTES // attack.UDP_CHUNK
    assert not res.ok and res.needed == grams
    assert res.sent == 3 * grams == len(got)

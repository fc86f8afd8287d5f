"""verify.CounterWindow's rule for when every frame has met its fate (the counters are read in the system tier;
tests/system/test_verify_load.py runs it under load). Readings here are what reading() returns."""

from __future__ import annotations

import re

import pytest
from hypafilter.ops.verify import CounterWindow, WindowError
from hypafilter.targets.emu.target import EmuTarget
from hypafilter.targets.xdp.target import XdpTarget


def window(host: bool = False, target=EmuTarget) -> CounterWindow:
    w = object.__new__(CounterWindow)  # no lab: only the rule is under test, with the target's stages
    w.host = host
    w.stages = target.window_stages
    return w


def reading(n: int = 10, stray: int = 0, state: int = 0, mirror: tuple[int, int] = (0, 0)) -> dict:
    """N frames sent: 2 forwarded by the NIC, 3 dropped, 5 shunted (`state` of them with reason 3, a flow-cache
    miss) of which the firewall forwarded 4; `stray` frames from the sender's own stack, shunted and forwarded by
    the firewall (counted at every stage). `mirror` = (a, d): a of the forwarded and d of the dropped frames were
    mirrored (bridge mode): each sent the host a copy, which the firewall took and discarded."""
    a, d = mirror
    nic = {
        "PKTIN": n + stray,
        "PKTOUT": 2 + 5 + 4 + 2 * stray + d,
        "CNT_FORWARDED": 2,
        "CNT_DROPPED": 3,
        "CNT_DROP_UNFILTERABLE": 0,
        "CNT_SHUNT_OVERRULE": 1,
        "CNT_SHUNT_POLICY": 3 + stray - state,
        "CNT_SHUNT_UNPARSED": 1,
        "CNT_SHUNT_STATE": state,
        "CNT_FROM_HOST": 4 + stray,
        "CNT_FIFO_DROP": 0,
        "CNT_MIRROR": a + d,
    }
    tx = {
        "send.hyb0": n + stray,
        "send.plain0": n,
        "nic.wire0": 0,
        "nic.wire1": 2 + 4 + stray,
        "nic.host0": 5 + stray + a + d,
        "nic.host1": 0,
        "fw.nf0": 0,
        "fw.nf1": 4 + stray,
        "plain.nf1": 6,
    }
    return {
        "sent": n,
        "nic": nic,
        "dev": {k: {"tx": v, "tx_dropped": 0} for k, v in tx.items()},
        "tapped": {
            "nic.wire0.ours": n,
            "nic.wire0": n + stray,
            "nic.wire1": 0,
            "fw.nf0": 5 + stray + a + d,
            "fw.nf1": 0,
            "plain.nf0.ours": n,
        },
        "captured": {"hybrid": 2 + 4 + stray, "plain": 6},
        "capture_drops": 0,
    }


@pytest.mark.parametrize("stray", [0, 1, 3])
def test_closed_when_every_stage_agrees(stray):
    assert window().missing(reading(stray=stray)) == []


# (target, where, key, delta, what the window says is missing): one frame not yet at that stage
ON_ITS_WAY = [
    ("emu", "tapped", "nic.wire0.ours", -1, "NIC took ours"),
    ("emu", "tapped", "fw.nf0", -1, "firewall took"),
    ("emu", "tapped", "plain.nf0.ours", -1, "plain took ours"),
    ("emu", "captured", "hybrid", -1, "receiver captured, hybrid"),
    ("emu", "captured", "plain", -1, "receiver captured, plain"),
    ("emu", "nic", "CNT_FROM_HOST", -1, "NIC took back"),
    ("emu", "nic", "CNT_SHUNT_POLICY", -1, "NIC decided"),
    ("xdp", "dev", "send.hyb0", -1, "sender's veth carried ours"),
    ("xdp", "nic", "PKTIN", -1, "fast path classified"),
    ("xdp", "nic", "CNT_SHUNT_STATE", -1, "fast path decided"),
    ("xdp", "nic", "PKTOUT", -1, "fast path sent"),
    ("xdp", "tapped", "fw.nf0", -1, "firewall took"),
    ("xdp", "captured", "hybrid", -1, "receiver captured, hybrid"),
    ("xdp", "tapped", "plain.nf0.ours", -1, "plain took ours"),
    ("xdp", "captured", "plain", -1, "receiver captured, plain"),
]


@pytest.mark.parametrize(("target", "where", "key", "delta", "expect"), ON_ITS_WAY)
def test_open_while_a_frame_is_on_its_way(target, where, key, delta, expect):
    r = reading(stray=1) if target == "emu" else xdp_reading()
    if where == "dev":
        r["dev"][key]["tx"] += delta
    else:
        r[where][key] += delta
    missing = window(target=EmuTarget if target == "emu" else XdpTarget).missing(r)
    assert missing and any(m.startswith(expect) for m in missing), missing


def test_xdp_sender_veth_is_bounded_below_only():
    """The sender's veth carried at least the N frames sent (more: its stack's own, where not quiet); fewer is a
    frame on its way, and the message says the bound."""
    r = xdp_reading()
    n = r["sent"]
    r["dev"]["send.hyb0"]["tx"] = n - 1
    assert f"sender's veth carried ours {n - 1}/{n}..inf" in window(target=XdpTarget).missing(r)
    r["dev"]["send.hyb0"]["tx"] = n + 3
    assert not any(m.startswith("sender's veth") for m in window(target=XdpTarget).missing(r))


def test_host_mode_does_not_wait_for_the_receiver():
    r = reading()
    r["captured"] = {"hybrid": 0, "plain": 0}
    assert window(host=True).missing(r) == []
    assert window().missing(r)


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["dev"]["fw.nf1"].update(tx_dropped=1),
        lambda r: r["nic"].update(CNT_FIFO_DROP=1),
        lambda r: r.update(capture_drops=2),
    ],
)
def test_a_lost_frame_is_an_error_not_a_verdict(change):
    r = reading()
    change(r)
    with pytest.raises(WindowError, match="lost frames"):
        window().missing(r)


def test_more_of_our_frames_than_were_sent_is_an_error():
    r = reading()
    r["tapped"]["plain.nf0.ours"] += 1
    with pytest.raises(WindowError, match="more frames with our ids"):
        window().missing(r)


def test_frames_shunted_as_state_unknown_count_as_decided():
    """Reason 3 (miss forcing in a policy that reads conntrack) is one of the NIC's decisions: a window whose shunts
    are partly state-unknown closes like any other."""
    assert window().missing(reading(state=2)) == []
    r = reading(state=2)
    r["nic"]["CNT_SHUNT_STATE"] -= 1  # one frame not yet decided
    r["nic"]["PKTOUT"] -= 1
    assert window().missing(r)


# --- the xdp target's stages: the fast path on the firewall's bridge ports, its per-CPU counters -------------------


def xdp_reading(n: int = 10, host: bool = False, mirror: tuple[int, int] = (0, 0)) -> dict:
    """N frames sent on the xdp lab: 2 accepted (redirected to the paired port; in host mode passed up with the
    decided mark), 3 dropped, 5 passed to the firewall's bridge (1 as state unknown), of which it forwarded 4.
    `mirror` = (a, d): a of the accepted and d of the dropped frames were mirrored: passed up with reason 4 (a
    mirrored ACCEPT in bridge mode leaves nf1 as the TC program's clone, as if redirected)."""
    a, d = mirror
    nic = {
        "PKTIN": n,
        "PKTOUT": 7 + d,
        "CNT_MIRROR": a + d,
        "CNT_FORWARDED": 2,
        "CNT_DROPPED": 3,
        "CNT_DROP_UNFILTERABLE": 0,
        "CNT_SHUNT_OVERRULE": 1,
        "CNT_SHUNT_POLICY": 2,
        "CNT_SHUNT_UNPARSED": 1,
        "CNT_SHUNT_STATE": 1,
    }
    tx = {"send.hyb0": n, "recv.hyb0": 0, "fw.nf0": 0, "fw.nf1": 4 if host else 6, "send.plain0": n, "plain.nf1": 6}
    return {
        "sent": n,
        "nic": nic,
        "dev": {k: {"tx": v, "tx_dropped": 0} for k, v in tx.items()},
        "tapped": {"fw.nf0": (7 if host else 5 + a) + d, "fw.nf1": 0, "plain.nf0.ours": n},
        "captured": {"hybrid": 0 if host else 6, "plain": 6},
        "capture_drops": 0,
    }


def test_xdp_closed_when_every_stage_agrees():
    assert window(target=XdpTarget).missing(xdp_reading()) == []
    assert window(host=True, target=XdpTarget).missing(xdp_reading(host=True)) == []
    # In host mode the accepted frames reach the bridge too: the bridge-mode balance does not close on them.
    assert window(target=XdpTarget).missing(xdp_reading(host=True))


def test_xdp_lost_frame_is_an_error_not_a_verdict():
    r = xdp_reading()
    r["dev"]["send.hyb0"]["tx_dropped"] = 1  # the firewall's end of the veth had no room (XDP's ring full)
    with pytest.raises(WindowError, match="lost frames"):
        window(target=XdpTarget).missing(r)


def test_xdp_mirrored_frames():
    """Log mirroring on the xdp target (docs/xdp.md): every mirrored frame passed once (PKTOUT gains the mirrored
    DROPs, bounded by CNT_MIRROR) and taken by the firewall; in bridge mode a mirrored ACCEPT also leaves nf1."""
    for host in (False, True):
        assert window(host=host, target=XdpTarget).missing(xdp_reading(host=host, mirror=(2, 1))) == []
    r = xdp_reading(mirror=(2, 1))
    r["tapped"]["fw.nf0"] -= 1  # a copy not through the bridge yet
    assert any(m.startswith("firewall took") for m in window(target=XdpTarget).missing(r))
    r = xdp_reading(mirror=(2, 1))
    r["nic"]["PKTOUT"] += 3  # more than every mirrored frame can explain
    sent = [m for m in window(target=XdpTarget).missing(r) if m.startswith("fast path sent")]
    assert len(sent) == 1 and re.fullmatch(r"fast path sent \d+/\d+\.\.\d+", sent[0]), sent


def test_mirrored_frames_counted_on_both_paths():
    """Log mirroring on the emulated NIC: a mirrored ACCEPT is forwarded on the wire AND its copy goes to the host,
    a mirrored DROP sends only the copy; both count in CNT_MIRROR besides CNT_FORWARDED / CNT_DROPPED
    (docs/hardware.md)."""
    assert window().missing(reading(stray=1, mirror=(2, 1))) == []
    r = reading(mirror=(2, 1))
    r["dev"]["nic.host0"]["tx"] -= 1  # a copy still inside the emulator
    r["tapped"]["fw.nf0"] -= 1
    assert any(m.startswith("NIC veths carried") for m in window().missing(r))
    # PKTOUT lies within bounds: forwarded + shunted + CNT_FROM_HOST (11) .. that + CNT_MIRROR (14)
    r = reading(mirror=(2, 1))
    r["nic"]["PKTOUT"] += 3  # more than every mirrored frame can explain
    assert "NIC sent 15/11..14" in window().missing(r)  # the message says the bounds
    r["nic"]["PKTOUT"] -= 5  # fewer than the frames sent without the mirrored DROPs
    assert "NIC sent 10/11..14" in window().missing(r)
    for pktout in (11, 14):  # both bounds included (the veths and the firewall decide the rest)
        r["nic"]["PKTOUT"] = pktout
        assert not any(m.startswith("NIC sent") for m in window().missing(r))
    r = reading(mirror=(2, 1))
    r["dev"]["nic.wire1"]["tx"] -= 1  # a mirrored ACCEPT's wire copy not out yet
    r["captured"]["hybrid"] -= 1
    assert any(m.startswith("NIC wire veths carried") for m in window().missing(r))

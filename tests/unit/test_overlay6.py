"""The IPv6 update buffer's alignment (analysis.overlay.align6, docs/ipv6.md "The update buffer for IPv6") without a
kernel: two ranked plans of differently ranked policies aligned in address space; the static entries kept, the
slots with raw 128-bit bounds, the SFL decision over them (static first valid match, then the first slot at or
before it) the new plan's first match for headers at and around every boundary; the slot rows as the program reads
them. The program itself against ip6tables: tests/system/test_xdp_v6.py::test_update_buffer6_decides_as_the_new_policy."""

from __future__ import annotations

import random

import pytest
from hypafilter.analysis.overlay import BufferFull, align6, unranked_boxes
from hypafilter.ir import FIELDS
from hypafilter.targets.xdp.tables import SLOT6, build_tables6, shape6, slot_rows6, tables6_records

from tests.xdp_v6 import Rule6, ranked_plan

STATIC = [
    Rule6(src="2001:db8:1::/48", proto="tcp", dport=(80, 88)),
    Rule6(dst="2001:db8:2::/48", proto="udp", dport=(53, 53)),
    Rule6(proto="icmpv6", icmp6=128),
    Rule6(src="::/0", dst="2001:db8:5::/48"),
]
MASTER = [Rule6(src="2001:db8:1::66/128", target="DROP"), STATIC[0], STATIC[1], Rule6(dst="2001:db8:9::/48"), STATIC[3]]


def holds(box, h) -> bool:
    return all(box.lo[i] <= h[i] <= box.hi[i] for i in range(len(FIELDS))) and (h[-1] & box.flags_mask) == (
        box.flags_value
    )


def first(entries, h, default):
    return next((j for j, bs in enumerate(entries) if any(holds(b, h) for b in bs)), default)


def headers(boxes, rng):
    """Headers at and around every bound of every box (addresses one past the edges included), plus random ones."""
    out = []
    for b in boxes:
        for _ in range(6):
            h = [rng.randint(lo, hi) for lo, hi in zip(b.lo, b.hi, strict=True)] + [b.flags_value]
            out.append(h)
            for i in range(len(FIELDS)):
                for v in (b.lo[i] - 1, b.lo[i], b.hi[i], b.hi[i] + 1):
                    if v >= 0 and v <= (1 << 128) - 1:
                        out.append([*h[:i], v, *h[i + 1 :]])
    return out


def test_align6_decides_as_the_master():
    _, s6 = ranked_plan(STATIC, "DROP")
    _, m6 = ranked_plan(MASTER, "DROP")
    assert s6.addr_map.starts["src"] != m6.addr_map.starts["src"]  # the ban adds elementary intervals
    view = align6(s6, m6, 8, k_base=3)
    ov = view.overlay
    assert list(ov.valid) == [True, True, False, True]  # the echo-request ACCEPT deleted
    ban = ov.slots[0]
    assert ban.pos == 0 and ban.box.lo[0] == ban.box.hi[0] == 0x20010DB8000100000000000000000066
    static = [unranked_boxes(s6, e) for e in s6.entries]
    master = [unranked_boxes(m6, e) for e in m6.entries]
    n, m = len(static), len(master)
    rng = random.Random(6)
    checked = 0
    for h in headers([b for bs in master + static for b in bs], rng):
        i = next((j for j, bs in enumerate(static) if ov.valid[j] and any(holds(b, h) for b in bs)), n)
        hw = next((n + 1 + b for b, s in enumerate(ov.slots) if s.pos <= i and holds(s.box, h)), i)
        assert view.master[hw] == first(master, h, m), (h, hw)
        checked += 1
    assert checked > 500
    # the rows are the master's, its non-zero k offset by k_base
    for hw, mj in enumerate(view.master):
        if mj >= 0:
            k = int(m6.interval[mj])
            assert view.interval[hw] == (k + 3 if k else 0) and view.actions[hw] == m6.actions[mj]


def test_slot_rows_and_a_full_buffer():
    _, s6 = ranked_plan(STATIC, "DROP")
    _, m6 = ranked_plan(MASTER, "DROP")
    view = align6(s6, m6, 4)
    rows = slot_rows6(view.overlay, 4)
    assert len(rows) == 4 * SLOT6.size
    f = SLOT6.unpack(rows[: SLOT6.size])
    assert f[0:4] == (0x20010DB8, 0x00010000, 0, 0x66) and f[0:4] == f[4:8]  # src lo == hi, words MSB first
    assert f[8:12] == (0, 0, 0, 0) and f[12:16] == (0xFFFFFFFF,) * 4  # dst: any
    assert f[-1] == 1 and SLOT6.unpack(rows[-SLOT6.size :])[-1] == 0  # enabled, the unused ones not
    t6 = build_tables6(s6)
    rec = tables6_records(t6, shape6(t6, 4), view=view, lookup=False)
    assert b"hfx6_buf" in rec and b"hfx6_vbox" in rec and b"hfx6_vec" not in rec
    with pytest.raises(BufferFull):
        align6(s6, m6, 1)

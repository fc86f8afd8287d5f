"""The IPv6 table set (targets.xdp.tables.build_tables6) without a kernel: the program's IPv6 lookup done in Python over
the tables — the 128-bit binary search of src and dst, the direct fields, the AND, the lowest set bit — must give the
ranked plan's first match (analysis.decision.match_index of the header with its addresses ranked by the plan's
addr_map) for addresses at and around every interval boundary; refusals of plans it cannot load."""

from __future__ import annotations

import bisect
import random
import struct

import numpy as np
import pytest
from hypafilter.analysis import decision
from hypafilter.ir import FIELDS, Header
from hypafilter.targets.xdp.tables import (
    CONFIG6,
    SEARCH_FIELDS,
    buffer6_words,
    build_tables,
    build_tables6,
    shape6,
    split_records,
    tables6_records,
    tables_file,
    words6_digest,
)

from tests.xdp_v6 import TOP, Rule6, ranked_plan

RULES = [
    Rule6(src="2001:db8:1::/48", proto="tcp", dport=(80, 88)),
    Rule6(src="2001:db8:1:5::/64", dst="2001:db8:2::/48", target="DROP"),
    Rule6(dst="2001:db8:2::/48", proto="udp", dport=(53, 53)),
    Rule6(proto="icmpv6", icmp6=128),
    Rule6(src="2001:db8::/32", proto="tcp", dport=(8000, 8999), complex_=True),
    Rule6(dst="ffff:ffff::/32", target="DROP"),  # up to the top address
    Rule6(src="::/128", proto="udp"),  # the bottom one
    Rule6(src="::/0", dst="2001:db8:5::/48"),
]


def starts128(t) -> dict[str, list[int]]:
    """The spans' 128-bit starts as ints (struct hfx_span6: four words, most significant first)."""
    out = {}
    for f, sp in t.spans.items():
        out[f] = [(int(a) << 96) | (int(b) << 64) | (int(c) << 32) | int(d) for a, b, c, d in sp["start"]]
        assert out[f][0] == 0 and out[f] == sorted(out[f])
    return out


def lookup6(t, starts: dict, vals: dict) -> int:
    """hfx_fastpath6's classify6 (driver/xdp/fastpath.bpf.c.j2), in Python."""
    if not t.boxes:
        return t.n
    acc = np.full(max(t.words, 1), np.uint64(0xFFFFFFFFFFFFFFFF))
    for f in t.fields:
        if f in SEARCH_FIELDS:
            vec = t.spans[f]["vec"][bisect.bisect_right(starts[f], vals[f]) - 1]
        else:
            vec = t.direct[f][vals[f]]
        acc &= t.vectors[vec]
    for w, word in enumerate(acc[: t.words]):
        if word:
            return int(t.box_entry[w * 64 + (int(word) & -int(word)).bit_length() - 1])
    return t.n


@pytest.mark.parametrize("mode", ["selective", "exact"])
def test_lookup6_is_the_ranked_first_match(mode):
    _, plan = ranked_plan(RULES, "DROP", mode=mode)
    t = build_tables6(plan)
    assert t.family == 6 and {"src", "dst"} <= set(t.fields)
    rng = random.Random(6)
    edges = {
        d: [s + o for s in plan.addr_map.starts[d] for o in (-1, 0, 1) if 0 <= s + o <= TOP] + [TOP]
        for d in SEARCH_FIELDS
    }
    starts = starts128(t)
    for _ in range(1500):
        vals = {d: rng.choice(edges[d]) if rng.random() < 0.7 else rng.randint(0, TOP) for d in SEARCH_FIELDS}
        vals["proto"] = rng.choice([6, 17, 58, 50, 0])
        vals["sport"] = rng.randint(0, 65535)
        vals["dport"] = rng.choice([53, 80, 88, 89, 8000, 8999, rng.randint(0, 65535)])
        vals["icmp_type"] = rng.choice([128, 129, 0]) if vals["proto"] == 58 else 0
        vals["icmp_code"] = 0
        vals["iport"] = rng.randint(0, 1)
        vals["ct"] = 0
        vals["flags"] = rng.randint(0, 255)
        ranked = {d: plan.addr_map.rank(d, vals[d]) for d in SEARCH_FIELDS}
        h = Header(**{**{f: vals[f] for f in FIELDS}, **ranked}, tcp_flags=vals["flags"])
        assert lookup6(t, starts, vals) == decision.match_index(plan, h), vals


def test_last_rank_reaches_the_top_address():
    """A box over every rank (0 .. the last, as a compress may write an unrestricted address) gives the tables of
    the unrestricted box: the same boxes without an address (HFX_BOX_WILD), the same conntrack-hit entries."""
    a = build_tables6(ranked_plan(RULES, "DROP", ct_first=True, hand=True)[1])
    b = build_tables6(ranked_plan(RULES, "DROP", ct_first=True, full_ranks=True, hand=True)[1])
    c = build_tables6(ranked_plan(RULES, "DROP", ct_first=True)[1])  # the front end's compress
    assert a.box_wild.tolist() == b.box_wild.tolist() and a.box_wild.any()
    assert a.ct_hit == b.ct_hit == c.ct_hit and a.ct_hit[0]
    assert c.box_wild.tolist() == a.box_wild.tolist()


def test_tables_file_and_index_base():
    """The IPv6 records before hfx_cfg; hfx6_cfg carries n6, the index base and the spans' counts; the spans are the
    128-bit starts, most significant word first; a plan with k_base moves every non-zero k."""
    _, plan = ranked_plan(RULES, "DROP", index_base=9)
    t4 = build_tables(ranked_plan(RULES[:2], "ACCEPT")[1])
    t6 = build_tables6(plan)
    shape = {**t4.shape(), "v6": shape6(t6)}
    blob = tables_file(t4, shape, 1, 0, t6=t6)
    names = []
    at = 0
    while at < len(blob):
        (n,) = struct.unpack_from("<I", blob, at)
        name = blob[at + 4 : at + 4 + n].decode()
        size, count = struct.unpack_from("<II", blob, at + 4 + n)
        if name == "hfx6_cfg":
            cfg = CONFIG6.unpack_from(blob, at + 12 + n)
            assert cfg[:5] == (len(plan.entries), 9, t6.words, len(t6.spans["src"]), len(t6.spans["dst"]))
        names.append(name)
        at += 12 + n + size * count
    assert names[-1] == "hfx_cfg" and names.index("hfx6_cfg") < len(names) - 1
    assert {"hfx6_vec", "hfx6_f_src", "hfx6_f_dst", "hfx6_box", "hfx6_ent"} <= set(names)
    top = t6.spans["dst"][-1]["start"]
    assert [int(x) for x in top] == [0xFFFFFFFF, 0, 0, 0]  # ffff:ffff::/32's start
    moved = build_tables6(plan, k_base=100)
    k = [struct.unpack_from("<BBHI", moved.entries, 8 * j)[3] for j in range(len(plan.entries) + 1)]
    assert k == [int(x) + 100 if int(x) else 0 for x in plan.interval]
    with pytest.raises(ValueError, match="IPv6 tables need"):
        tables_file(t4, t4.shape(), 1, 0, t6=t6)
    small = dict(shape["v6"], nb_cap=1)
    with pytest.raises(ValueError, match="do not fit"):
        tables6_records(t6, small)


def test_buffer6_words_cover_every_row_and_the_mask():
    """What the state keeps of the IPv6 update buffer's maps (drift reads them back): hfx6_ent's every row (the static
    entries', the policy entry's and each slot's), hfx6_buf and hfx6_vbox, each a count and a digest of its words;
    one byte of one row changes that map's digest alone."""
    _, plan = ranked_plan(RULES, "DROP", index_base=9)
    t6 = build_tables6(plan)
    records = tables6_records(t6, shape6(t6, 4))
    words = buffer6_words(records)
    assert sorted(words) == ["hfx6_buf", "hfx6_ent", "hfx6_vbox"]
    assert words["hfx6_ent"][0] == len(plan.entries) + 1 + 4 and words["hfx6_buf"][0] == 4, words
    assert words["hfx6_vbox"][0] == 1, words
    ent = next(r for r in split_records(records) if r[0] == "hfx6_ent")[3]
    changed = ent[:8] + bytes([ent[8] ^ 1]) + ent[9:]  # row 1's action
    assert words6_digest(changed) != words["hfx6_ent"][1] and words6_digest(ent) == words["hfx6_ent"][1]
    # a program without the buffer: its rows alone (the state keeps `words` only where there is a buffer)
    assert list(buffer6_words(tables6_records(t6, shape6(t6)))) == ["hfx6_ent"]


def test_refusals():
    _, plan = ranked_plan(RULES, "DROP")
    plan.family = 4
    with pytest.raises(ValueError, match="family-6"):
        build_tables6(plan)
    plan.family = 6
    good = plan.addr_map.starts["src"]
    plan.addr_map.starts["src"] = [1, *good[1:]]
    with pytest.raises(ValueError, match="rise strictly from 0"):
        build_tables6(plan)
    plan.addr_map.starts["src"] = good
    del plan.addr_map
    with pytest.raises(ValueError, match="addr_map"):
        build_tables6(plan)


def test_plan6_for_a_deployment():
    """deploy's hook (targets.xdp.v6.plan6_for): the IPv6 side's plan with the index base after the IPv4 plan and its
    k after the IPv4 plan's largest k (its interval chains are in ip6tables), or k 0 when ip6tables holds the policy
    verbatim; read again from the text when the state is all there is; None with the reason otherwise."""
    from hypafilter.config import Config
    from hypafilter.netfilter.ip6 import V6Policy
    from hypafilter.targets.xdp.v6 import plan6_for

    text, _ = ranked_plan(RULES, "DROP")
    _, plan4 = ranked_plan(RULES[:3], "ACCEPT")
    v6 = V6Policy("v6.rules", text, "FORWARD", "policy", ("filter",))
    on = Config(xdp_ipv6=True)
    p6, why = plan6_for(v6, on, plan4)
    assert why == "" and p6.family == 6 and p6.index_base == len(plan4.entries) + 1 + on.update_buffer
    assert not p6.verbatim and p6.k_base == plan4.num_intervals > 0 and p6.live
    t6 = build_tables6(p6)
    ks = [struct.unpack_from("<BBHI", t6.entries, 8 * j)[3] for j in range(t6.n + 1)]
    assert t6.soft == 0 and ks == [int(k) + p6.k_base if int(k) else 0 for k in p6.interval]
    p6, why = plan6_for(v6, on, plan4, k_base=7, verbatim=True)  # a follow keeps ip6tables' k; verbatim: k 0
    assert p6.k_base == 7 and p6.verbatim
    t6 = build_tables6(p6)
    assert t6.soft == 1 and not any(struct.unpack_from("<BBHI", t6.entries, 8 * j)[3] for j in range(t6.n + 1))
    assert any(int(k) for k in p6.interval)  # the plan's own k, zeroed in the tables only
    assert plan6_for(v6, Config(), plan4)[1] == ""  # on by default
    assert plan6_for(v6, Config(xdp_ipv6=False), plan4) == (None, "xdp_ipv6 is off in the configuration")
    assert plan6_for(None, on, plan4)[0] is None
    assert "besides filter" in plan6_for(V6Policy("v6.rules", text, tables=("filter", "raw")), on, plan4)[1]
    bad = V6Policy("v6.rules", text.replace("-p 6", "-p nosuchproto"), tables=("filter",))
    assert "does not read again" in plan6_for(bad, on, plan4)[1]


def test_the_close_wait_timeout_reaches_both_configs():
    """CtConfig.tcp_cw_ms (what a frame decided on a half-closed TCP entry refreshes it to; 0: such entries are not
    decided) is the last word of hfx_config and of hfx6_config, each family's from its own CtConfig."""
    from hypafilter.targets.xdp.tables import CONFIG, CtConfig, tables_file

    t6 = build_tables6(ranked_plan(RULES, "DROP")[1])
    t4 = build_tables(ranked_plan(RULES[:2], "ACCEPT")[1])
    shape = {**t4.shape(), "v6": shape6(t6)}
    ct4 = CtConfig(lookup=True, tcp_ms=1000, tcp_cw_ms=60_000)
    ct6 = CtConfig(lookup=True, tcp_ms=2000, tcp_cw_ms=30_000)
    blob = tables_file(t4, shape, 1, 0, ct=ct4, t6=t6, ct6=ct6)
    rec, at = {}, 0
    while at < len(blob):
        (n,) = struct.unpack_from("<I", blob, at)
        name = blob[at + 4 : at + 4 + n].decode()
        size, count = struct.unpack_from("<II", blob, at + 4 + n)
        rec[name] = blob[at + 12 + n : at + 12 + n + size * count]
        at += 12 + n + size * count
    cfg, cfg6 = CONFIG.unpack(rec["hfx_cfg"]), CONFIG6.unpack(rec["hfx6_cfg"])
    # hfx6_config's ct_tcp_cw_ms is its 15th word (buf_scan follows it)
    assert (cfg[7], cfg[-1]) == (1000, 60_000) and (cfg6[10], cfg6[14]) == (2000, 30_000)
    assert CONFIG.unpack(tables_file(t4, {**t4.shape()}, 1, 0)[-CONFIG.size :])[-1] == 0  # no lookup: not decided

"""The ClassBench trace mapped into IPv6 beside its filter set (tools.classbench6.v6_trace; docs/ipv6.md "bench rate
with IPv6"): a header that its filter's IPv4 rule holds is held by that filter's IPv6 rule, 128 bits compared."""

from __future__ import annotations

import ipaddress

import pytest
from hypafilter.iptables.document import parse_policy
from hypafilter.tools.classbench import classbench_policy, classbench_policy_text, read_trace
from hypafilter.tools.classbench6 import BASE, v6_policy_text, v6_trace


def _inside(box, point: dict) -> bool:
    return all(box.interval(f)[0] <= v <= box.interval(f)[1] for f, v in point.items())


@pytest.mark.shared
def test_trace_headers_stay_in_their_filters_ipv6_rule(shared_dir):
    filters = shared_dir / "data/classbench/acl1_1100.filters"
    v4 = classbench_policy(filters)
    text6 = v6_policy_text(classbench_policy_text(filters))
    v6 = parse_policy(text6, filename="acl1_1100 (IPv6)", family=6)
    assert len(v6.rules) == len(v4.rules)
    rows = read_trace(shared_dir / "data/classbench/acl1_1100_trace.gz").tolist()[:3000]
    headers = v6_trace(text6, rows, seed=3)
    assert headers == v6_trace(text6, rows, seed=3) and headers != v6_trace(text6, rows, seed=4)
    held = lengthened = 0
    for row, h in zip(rows, headers, strict=True):
        six = {"src": int(ipaddress.IPv6Address(h["src"])), "dst": int(ipaddress.IPv6Address(h["dst"]))}
        assert (h["proto"], h["sport"], h["dport"]) == (row[4], row[2], row[3])
        i = row[6]  # the filter's 0-based index
        assert _inside(v4.rules[i].boxes[0], {"src": row[0], "dst": row[1]}), row
        (box,) = v6.rules[i].boxes
        assert _inside(box, six), (row, h, box)  # in its filter's IPv6 rule, 128 bits compared
        held += 1
        for dim, a in (("src", row[0]), ("dst", row[1])):
            lo4, hi4 = v4.rules[i].boxes[0].interval(dim)
            lo6, hi6 = box.interval(dim)
            if 128 - (hi6 - lo6).bit_length() == 32 + 32 - (hi4 - lo4).bit_length():
                # a prefix the mapping did not lengthen: the header is its IPv4 address moved as the prefixes are
                assert six[dim] >> 64 == (BASE >> 64) | a, (dim, row, h)
            else:
                lengthened += 1
    assert held == len(rows) and lengthened > 100, (held, lengthened)

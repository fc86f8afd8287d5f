"""ClassBench filter sets as IPv6 policies (docs/ipv6.md "Input and IR"): an iptables-save text of a ClassBench import
(tools.classbench) rewritten into an ip6tables-save text, for the IPv6 analysis benchmark and `-6 --classbench`.

The mapping (deterministic, seed 25 unless given):
- an IPv4 prefix a/len becomes 2001:db8:(a >> 16):(a & 0xffff)::/(32 + len): the 32-bit address space moved into the
  /32 after 2001:db8::/32, so the filter set's prefix structure (nesting, overlaps) is kept exactly;
- each mapped prefix of length 48 or more (IPv4 /16 or longer), with probability 1/2, is then lengthened to a random
  length in [max(its length, 48), 128] with random bits below its own: /48-/128 prefixes that use the whole
  128 bits, as IPv6 site, subnet and host rules do;
- a rule without -s/-d stays without it (every IPv6 address).
"""

from __future__ import annotations

import random
import re

from hypafilter.iptables.canonical import ip6_str

_ADDR = re.compile(r"(?<=\s)(-[sd]) (\d+\.\d+\.\d+\.\d+)(?:/(\d+))?(?=\s)")
BASE = 0x20010DB8 << 96


def v6_prefix(v4: int, length: int, rnd: random.Random) -> tuple[int, int]:
    """(network, prefix length) of an IPv4 prefix under the mapping above."""
    net, plen = BASE | (v4 << 64), 32 + length
    if plen >= 48 and rnd.random() < 0.5:
        new = rnd.randint(max(plen, 48), 128)
        if new > plen:
            net |= rnd.getrandbits(new - plen) << (128 - new)
        plen = new
    return net, plen


def v6_policy_text(text: str, seed: int = 25) -> str:
    """The ip6tables-save text of an iptables-save text of a ClassBench import (only -s/-d change)."""
    rnd = random.Random(seed)

    def sub(m: re.Match) -> str:
        a = [int(x) for x in m.group(2).split(".")]
        v4 = (a[0] << 24) | (a[1] << 16) | (a[2] << 8) | a[3]
        net, plen = v6_prefix(v4, int(m.group(3) or 32), rnd)
        return f"{m.group(1)} {ip6_str(net)}/{plen}"

    return "\n".join(_ADDR.sub(sub, line) if line.startswith("-A ") else line for line in text.split("\n"))

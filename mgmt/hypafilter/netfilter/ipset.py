"""The kernel's ipsets as the fast path needs them: `ipset save` text read into ir.sets.SetInfo (from a file given
with --ipsets, or from the live kernel of a namespace), and sets created in a namespace (labs, the oracle).

Only what `ipset save` writes is read (one `create` line per set, then its `add` lines); any other line, an
unknown option or a malformed element is an error naming file, line and token, and nothing is applied.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import replace

from hypafilter import netns
from hypafilter.errors import HypafilterError, PolicyError
from hypafilter.ir.sets import SET_TYPES, SetElem, SetInfo

# The ICMP names `ipset save` prints for hash:*,port elements (type, code): ipset's own table, checked against the
# tool here by adding every icmp:TYPE/CODE and saving (the names it prints for the rest are TYPE/CODE).
ICMP_NAMES = {
    "echo-reply": (0, 0), "pong": (0, 0), "network-unreachable": (3, 0), "host-unreachable": (3, 1),
    "protocol-unreachable": (3, 2), "port-unreachable": (3, 3), "fragmentation-needed": (3, 4),
    "source-route-failed": (3, 5), "network-unknown": (3, 6), "host-unknown": (3, 7),
    "network-prohibited": (3, 9), "host-prohibited": (3, 10), "TOS-network-unreachable": (3, 11),
    "TOS-host-unreachable": (3, 12), "communication-prohibited": (3, 13), "host-precedence-violation": (3, 14),
    "precedence-cutoff": (3, 15), "source-quench": (4, 0), "network-redirect": (5, 0), "host-redirect": (5, 1),
    "TOS-network-redirect": (5, 2), "TOS-host-redirect": (5, 3), "echo-request": (8, 0), "ping": (8, 0),
    "router-advertisement": (9, 0), "router-solicitation": (10, 0), "ttl-zero-during-transit": (11, 0),
    "ttl-zero-during-reassembly": (11, 1), "ip-header-bad": (12, 0), "required-option-missing": (12, 1),
    "timestamp-request": (13, 0), "timestamp-reply": (14, 0), "address-mask-request": (17, 0),
    "address-mask-reply": (18, 0),
}  # fmt: skip
# The same for ICMPv6 (`ipv6-icmp:NAME` in an inet6 hash:*,port set), read back from the tool the same way.
ICMPV6_NAMES = {
    "no-route": (1, 0), "communication-prohibited": (1, 1), "address-unreachable": (1, 3),
    "port-unreachable": (1, 4), "packet-too-big": (2, 0), "ttl-zero-during-transit": (3, 0),
    "ttl-zero-during-reassembly": (3, 1), "bad-header": (4, 0), "unknown-header-type": (4, 1),
    "unknown-option": (4, 2), "echo-request": (128, 0), "echo-reply": (129, 0), "router-solicitation": (133, 0),
    "router-advertisement": (134, 0), "neighbour-solicitation": (135, 0), "neighbour-advertisement": (136, 0),
    "redirect": (137, 0),
}  # fmt: skip
# create options with a value, and flags; anything else is refused
_VALUED = {
    "family", "hashsize", "maxelem", "bucketsize", "initval", "timeout", "netmask", "range", "markmask", "bitmask",
    "size",
}  # fmt: skip
_FLAGS = {"counters", "comment", "skbinfo", "forceadd"}
# element options: ignored for membership except timeout and nomatch
_ELEM_VALUED = {"timeout", "packets", "bytes", "comment", "skbmark", "skbprio", "skbqueue"}
_PROTO_ALIASES = {"tcp": 6, "udp": 17, "icmp": 1, "sctp": 132, "udplite": 136, "ipv6-icmp": 58}


def _proto(name: str) -> int:
    if name.isdigit():
        v = int(name)
        if v > 255:
            raise ValueError(name)
        return v
    if name in _PROTO_ALIASES:
        return _PROTO_ALIASES[name]
    return socket.getprotobyname(name)


def _port_part(text: str) -> tuple[int, int]:
    """'tcp:80' / 'icmp:echo-request' / 'icmp:8/0' / 'ipv6-icmp:echo-request' / 'gre:0' / '80' (tcp) -> (proto, port as
    the kernel keys it)."""
    proto_s, sep, port_s = text.rpartition(":")
    if not sep:
        proto_s, port_s = "tcp", text
    proto = _proto(proto_s)
    if proto in (1, 58):  # the kernel keys ICMP and ICMPv6 as type << 8 | code
        names = ICMP_NAMES if proto == 1 else ICMPV6_NAMES
        if port_s in names:
            t, c = names[port_s]
        else:
            t_s, _, c_s = port_s.partition("/")
            t, c = int(t_s), int(c_s or 0)
            if not (0 <= t <= 255 and 0 <= c <= 255):
                raise ValueError(text)
        return proto, t << 8 | c
    if port_s.isdigit():
        port = int(port_s)
    else:
        port = socket.getservbyname(port_s, proto_s)
    if not 0 <= port <= 0xFFFF:
        raise ValueError(text)
    return proto, port


def _net(text: str, default_prefix: int = 32) -> tuple[int, int, int]:
    """(first, last, prefix length) of `a.b.c.d[/len]` (the address masked: ipset saves nets masked)."""
    addr, sep, plen = text.partition("/")
    parts = addr.split(".")
    if len(parts) != 4 or not all(p.isdigit() and len(p) <= 3 for p in parts):
        raise ValueError(text)
    a, b, c, d = (int(p) for p in parts)
    if max(a, b, c, d) > 255:
        raise ValueError(text)
    prefix = int(plen) if sep else default_prefix
    if not 0 <= prefix <= 32:
        raise ValueError(text)
    v = a << 24 | b << 16 | c << 8 | d
    mask = (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF
    return v & mask, (v & mask) | (~mask & 0xFFFFFFFF), prefix


def _net6(text: str, default_prefix: int = 128) -> tuple[int, int, int]:
    """(first, last, prefix length) of an IPv6 `addr[/len]` (masked, as ipset saves nets)."""
    addr, sep, plen = text.partition("/")
    if ":" not in addr or "%" in addr:
        raise ValueError(text)
    v = int(ipaddress.IPv6Address(addr))  # ValueError when malformed
    if sep and not plen.isdigit():
        raise ValueError(text)
    prefix = int(plen) if sep else default_prefix
    if not 0 <= prefix <= 128:
        raise ValueError(text)
    top = (1 << 128) - 1
    mask = (top << (128 - prefix)) & top
    return v & mask, (v & mask) | (~mask & top), prefix


def parse_element(info: SetInfo, text: str) -> SetElem:
    """One element as `ipset save` writes it for this set (options excluded); ValueError when malformed."""
    t = info.settype
    if t == "bitmap:port":
        port = int(text)
        lo, hi = info.port_range
        if not lo <= port <= hi:
            raise ValueError(text)
        return SetElem(port=port)
    addr, _, rest = text.partition(",")
    v6 = info.family == "inet6"
    net, full = (_net6, 128) if v6 else (_net, 32)
    if t in ("hash:ip,port", "hash:net,port"):
        if not rest:
            raise ValueError(text)
        proto, port = _port_part(rest)
    elif rest:
        raise ValueError(text)
    else:
        proto, port = 0, 0
    if t.startswith("hash:net"):
        lo, hi, prefix = net(addr, full)
        if prefix == 0:
            raise ValueError(text)  # the kernel refuses /0 in hash:net
    else:
        lo, hi, prefix = net(addr, full)
        if prefix != full:
            raise ValueError(text)
        if info.netmask != full:  # the kernel keys the address masked by the set's netmask (saved masked)
            top = (1 << full) - 1
            mask = (top << (full - info.netmask)) & top
            lo, hi, prefix = lo & mask, (lo & mask) | (~mask & top), info.netmask
    return SetElem(lo, hi, prefix, proto, port)


def parse_save(text: str, filename: str = "<ipsets>") -> dict[str, SetInfo]:
    """Every set of an `ipset save` text (family inet and inet6, every type: what the fast path cannot implement is
    said by SetInfo.supported), in file order."""
    sets: dict[str, SetInfo] = {}
    elems: dict[str, list[SetElem]] = {}
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        w = line.split()

        def err(msg: str, tok: str, raw=raw, no=no) -> PolicyError:
            col = raw.find(tok) + 1 if tok else 0
            return PolicyError(msg, filename, no, col, tok)

        if w[0] in ("create", "-N", "-N"):
            if len(w) < 3:
                raise err("create needs a set name and type", w[0])
            name, stype = w[1], w[2]
            if name in sets:
                raise err(f"set {name} is created twice", name)
            opts: dict[str, str] = {}
            flags: list[str] = []
            i = 3
            while i < len(w):
                o = w[i]
                if o in _VALUED:
                    if i + 1 >= len(w):
                        raise err(f"option {o} needs a value", o)
                    opts[o] = w[i + 1]
                    i += 2
                elif o in _FLAGS:
                    flags.append(o)
                    i += 1
                elif stype not in SET_TYPES:  # a type the fast path leaves to netfilter: its options kept as read
                    flags.append(o)
                    i += 1
                else:
                    raise err(f"unknown create option {o}", o)
            try:
                port_range = (0, 65535)
                if "range" in opts and stype == "bitmap:port":
                    a, _, b = opts["range"].partition("-")
                    port_range = (int(a), int(b or a))
                family = opts.get("family", "inet")
                info = SetInfo(
                    name,
                    stype,
                    family=family,
                    hashsize=int(opts.get("hashsize", 1024)),
                    maxelem=int(opts.get("maxelem", 65536)),
                    netmask=int(opts.get("netmask", 128 if family == "inet6" else 32)),
                    timeout_default=int(opts["timeout"]) if "timeout" in opts else None,
                    port_range=port_range,
                    options=tuple(flags) + tuple(f"{k} {v}" for k, v in opts.items() if k in ("markmask", "bitmask")),
                )
            except ValueError:
                raise err(f"bad create options for set {name}", name) from None
            if stype == "bitmap:port":
                info = replace(info, maxelem=info.port_range[1] - info.port_range[0] + 1)
            sets[name] = info
            elems[name] = []
        elif w[0] in ("add", "-A"):
            if len(w) < 3:
                raise err("add needs a set name and an element", w[0])
            name = w[1]
            if name not in sets:
                raise err(f"set {name} is not created before its elements", name)
            info = sets[name]
            timeout, nomatch, i = None, False, 3
            while i < len(w):
                o = w[i]
                if o == "nomatch":
                    nomatch, i = True, i + 1
                elif o in _ELEM_VALUED:
                    if i + 1 >= len(w):
                        raise err(f"element option {o} needs a value", o)
                    if o == "timeout":
                        timeout = int(w[i + 1]) if w[i + 1].isdigit() else -1
                        if timeout < 0:
                            raise err("bad timeout", w[i + 1])
                    if (
                        o == "comment"
                        and w[i + 1].startswith('"')
                        and not (len(w[i + 1]) > 1 and w[i + 1].endswith('"'))
                    ):
                        j = i + 2
                        while j < len(w) and not w[j].endswith('"'):
                            j += 1
                        i = j + 1
                        continue
                    i += 2
                elif info.settype not in SET_TYPES or info.family not in ("inet", "inet6"):
                    i += 1  # an element of a set netfilter alone decides: not read
                else:
                    raise err(f"unknown element option {o}", o)
            if info.family not in ("inet", "inet6") or info.settype not in SET_TYPES:
                elems[name].append(SetElem(timeout_s=timeout, nomatch=nomatch))  # kept for counting only
                continue
            try:
                e = parse_element(info, w[2])
            except (ValueError, OSError):
                raise err(f"bad element for a {info.settype} set", w[2]) from None
            if nomatch and not info.settype.startswith("hash:net"):
                raise err("nomatch only exists in hash:net types", "nomatch")
            if timeout == 0 or info.timeout_default is None:
                timeout = None  # 0: permanent in a set with timeouts; none without them
            elems[name].append(replace(e, timeout_s=timeout, nomatch=nomatch))
        else:
            raise err("not an `ipset save` line (create or add)", w[0])
    return {n: replace(s, entries=tuple(elems[n])) for n, s in sets.items()}


def read_file(path: str) -> tuple[dict[str, SetInfo], str]:
    """The sets of an `ipset save` file, and its text (what labs and the oracle restore)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise HypafilterError(f"{path}: {e.strerror}") from e
    return parse_save(text, path), text


def save_text(ns: str | None, name: str | None = None) -> str:
    """`ipset save` of namespace `ns` (every set, or one)."""
    try:
        return netns.run(["ipset", "save", *([name] if name else [])], ns)
    except netns.CommandError as e:
        raise HypafilterError(f"reading the kernel's ipsets{f' in {ns}' if ns else ''} failed: {e}") from e


def read_live(ns: str | None, name: str | None = None) -> dict[str, SetInfo]:
    """The kernel's sets of namespace `ns` now."""
    return parse_save(save_text(ns, name), f"ipset save{f' ({ns})' if ns else ''}")


def restore(ns: str | None, text: str) -> None:
    """The sets of an `ipset save` text created in namespace `ns`, replacing sets of the same names: every set of the
    text is flushed first (created when missing), so the namespace holds exactly the text's elements."""
    sets = parse_save(text)
    try:
        existing = set(netns.run(["ipset", "list", "-n"], ns).split())
        lines = []
        for name in sets:
            if name in existing:
                lines.append(f"flush {name}")
        body = "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#"))
        netns.run(["ipset", "restore", "-exist"], ns, input="\n".join(lines) + "\n" + body + "\n")
    except netns.CommandError as e:
        raise HypafilterError(f"creating the ipsets{f' in {ns}' if ns else ''} failed: {e}") from e

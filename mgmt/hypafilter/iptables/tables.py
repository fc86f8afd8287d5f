"""Built-in name tables of iptables (protocols, services, ICMP types, TCP flags, targets) used by the parser."""

from __future__ import annotations

# Protocol names as `iptables -p` accepts them and `iptables -S` prints them (a fixed subset of /etc/protocols,
# built in so that the result never depends on the machine the compiler runs on).
PROTO_BY_NAME: dict[str, int] = {
    "icmp": 1,
    "igmp": 2,
    "ipencap": 4,
    "tcp": 6,
    "egp": 8,
    "igp": 9,
    "pup": 12,
    "udp": 17,
    "hmp": 20,
    "xns-idp": 22,
    "rdp": 27,
    "iso-tp4": 29,
    "dccp": 33,
    "xtp": 36,
    "ddp": 37,
    "idpr-cmtp": 38,
    "ipv6": 41,
    "ipv6-route": 43,
    "ipv6-frag": 44,
    "idrp": 45,
    "rsvp": 46,
    "gre": 47,
    "esp": 50,
    "ah": 51,
    "skip": 57,
    "ipv6-icmp": 58,
    "ipv6-nonxt": 59,
    "ipv6-opts": 60,
    "rspf": 73,
    "vmtp": 81,
    "eigrp": 88,
    "ospf": 89,
    "ax.25": 93,
    "ipip": 94,
    "etherip": 97,
    "encap": 98,
    "pim": 103,
    "ipcomp": 108,
    "vrrp": 112,
    "l2tp": 115,
    "isis": 124,
    "sctp": 132,
    "fc": 133,
    "mobility-header": 135,
    "udplite": 136,
    "mpls-in-ip": 137,
    "manet": 138,
    "hip": 139,
    "shim6": 140,
    "wesp": 141,
    "rohc": 142,
    "ethernet": 143,
}
PROTO_ALIASES: dict[str, int] = {"icmpv6": 58, "ipv6-mh": 135, "mh": 135, "ospfigp": 89, "vrrp": 112}
PROTO_NAME: dict[int, str] = {v: k for k, v in PROTO_BY_NAME.items()}

# Service names for ports (a small fixed subset of /etc/services; the parser prints numbers, as iptables does).
SERVICES: dict[str, int] = {
    "ftp-data": 20,
    "ftp": 21,
    "ssh": 22,
    "telnet": 23,
    "smtp": 25,
    "domain": 53,
    "bootps": 67,
    "bootpc": 68,
    "tftp": 69,
    "http": 80,
    "www": 80,
    "kerberos": 88,
    "pop3": 110,
    "sunrpc": 111,
    "ident": 113,
    "auth": 113,
    "ntp": 123,
    "netbios-ns": 137,
    "netbios-dgm": 138,
    "netbios-ssn": 139,
    "imap": 143,
    "imap2": 143,
    "snmp": 161,
    "snmp-trap": 162,
    "bgp": 179,
    "ldap": 389,
    "https": 443,
    "microsoft-ds": 445,
    "isakmp": 500,
    "syslog": 514,
    "submission": 587,
    "ldaps": 636,
    "imaps": 993,
    "pop3s": 995,
    "openvpn": 1194,
    "mysql": 3306,
    "rdp": 3389,
    "ms-wbt-server": 3389,
    "postgresql": 5432,
    "http-alt": 8080,
}

# ICMP names: name -> (type, code_min, code_max), as in iptables' libipt_icmp table.
ICMP_TYPES: dict[str, tuple[int, int, int]] = {
    "any": (0xFF, 0, 0xFF),
    "echo-reply": (0, 0, 0xFF),
    "pong": (0, 0, 0xFF),
    "destination-unreachable": (3, 0, 0xFF),
    "network-unreachable": (3, 0, 0),
    "host-unreachable": (3, 1, 1),
    "protocol-unreachable": (3, 2, 2),
    "port-unreachable": (3, 3, 3),
    "fragmentation-needed": (3, 4, 4),
    "source-route-failed": (3, 5, 5),
    "network-unknown": (3, 6, 6),
    "host-unknown": (3, 7, 7),
    "network-prohibited": (3, 9, 9),
    "host-prohibited": (3, 10, 10),
    "tos-network-unreachable": (3, 11, 11),
    "tos-host-unreachable": (3, 12, 12),
    "communication-prohibited": (3, 13, 13),
    "host-precedence-violation": (3, 14, 14),
    "precedence-cutoff": (3, 15, 15),
    "source-quench": (4, 0, 0xFF),
    "redirect": (5, 0, 0xFF),
    "network-redirect": (5, 0, 0),
    "host-redirect": (5, 1, 1),
    "tos-network-redirect": (5, 2, 2),
    "tos-host-redirect": (5, 3, 3),
    "echo-request": (8, 0, 0xFF),
    "ping": (8, 0, 0xFF),
    "router-advertisement": (9, 0, 0xFF),
    "router-solicitation": (10, 0, 0xFF),
    "time-exceeded": (11, 0, 0xFF),
    "ttl-exceeded": (11, 0, 0xFF),
    "ttl-zero-during-transit": (11, 0, 0),
    "ttl-zero-during-reassembly": (11, 1, 1),
    "parameter-problem": (12, 0, 0xFF),
    "ip-header-bad": (12, 0, 0),
    "required-option-missing": (12, 1, 1),
    "timestamp-request": (13, 0, 0xFF),
    "timestamp-reply": (14, 0, 0xFF),
    "address-mask-request": (17, 0, 0xFF),
    "address-mask-reply": (18, 0, 0xFF),
}

# TCP flag names in the bit order iptables prints them (byte 13 of the TCP header).
TCP_FLAGS: tuple[tuple[str, int], ...] = (
    ("FIN", 0x01),
    ("SYN", 0x02),
    ("RST", 0x04),
    ("PSH", 0x08),
    ("ACK", 0x10),
    ("URG", 0x20),
)
TCP_FLAG_WORDS: dict[str, int] = {**dict(TCP_FLAGS), "ALL": 0x3F, "NONE": 0}

# Matches whose result depends on state they change when evaluated (token buckets, counters, random draws,
# address lists): evaluating such a check more or fewer times than the original chain walk would changes
# behaviour, so rules carrying them are never duplicated by chain flattening.
STATEFUL_MATCHES = frozenset(
    {"limit", "hashlimit", "recent", "statistic", "quota", "connlimit", "nfacct", "rateest", "random", "nth"}
)

# Matches and targets that read the connection tracking table. A packet conntrack never saw (one the fast path
# accepted by itself) has no entry there, so a policy with any of these must let conntrack see every packet it
# accepts (ARCHITECTURE §2: the fast path never accepts a frame conntrack has not seen).
CONNTRACK_MATCHES = frozenset({"conntrack", "state", "connmark", "connbytes", "connlabel", "connlimit", "helper"})
CONNTRACK_TARGETS = frozenset({"CONNMARK", "CONNSECMARK", "CT"})

BUILTIN_CHAINS = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
    "security": ("INPUT", "FORWARD", "OUTPUT"),
}

"""The bridge-family nftables table that drops frames the bridge's netfilter cannot filter (two VLAN tags).

br_netfilter hands iptables untagged frames and frames with one tag (802.1Q or 802.1ad: the kernel strips one
tag before iptables looks); a frame with two tags crosses the bridge without any iptables rule. The NIC drops
such frames by default (Config.unfilterable = "drop"); this table makes the firewall host do the same for the
frames the NIC hands it while it is not classifying (reset, standby, tables loading), and makes the kernel
oracle of `verify` judge them as the deployed system does. With "pass" the table is removed: kernel-exact.
"""

from __future__ import annotations

TABLE = "hf_unfilterable"
VLAN_TPIDS = "{ 0x8100, 0x88a8 }"


def unfilterable_nft(unfilterable: str) -> str:
    """`nft -f` input: the table (re)created with its drop rule for "drop", only removed for "pass"."""
    text = f"add table bridge {TABLE}\ndelete table bridge {TABLE}\n"
    if unfilterable == "drop":
        # The inner tag's TPID sits 4 bytes after the outer one: link-layer bits 128..143.
        text += (
            f"table bridge {TABLE} {{\n"
            "\tchain prerouting {\n"
            "\t\ttype filter hook prerouting priority -300; policy accept;\n"
            f"\t\tether type {VLAN_TPIDS} @ll,128,16 {VLAN_TPIDS} counter drop\n"
            "\t}\n"
            "}\n"
        )
    return text

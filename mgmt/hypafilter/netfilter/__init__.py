"""The netfilter artifacts of a Plan: the software chain program rendered as iptables-restore text and as nft text."""

"""Source-to-source optimisation of iptables rule sets: decision trees encoded as jump chains (HiTables,
papers/trees-in-the-list-hitables.txt), exact for every packet (docs/optimize.md)."""

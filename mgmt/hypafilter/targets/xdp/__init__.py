"""Target `xdp`: hypafilter's fast path as an XDP program on commodity NICs (docs/xdp.md)."""

"""hypafilter: hybrid FPGA + Linux netfilter firewall (a reimplementation of HyPaFilter+)."""

__version__ = "0.1.0"

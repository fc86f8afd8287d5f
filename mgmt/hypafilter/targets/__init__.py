"""Where a Plan runs: the Target interface with the emulated NIC and NetFPGA SUME behind it, the register
client, and the eBPF shim that turns hardware metadata into the netfilter mark."""

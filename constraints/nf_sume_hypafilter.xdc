# Timing constraints for hypafilter_core on NetFPGA SUME (xc7vx690t-3-ffg1761), out-of-context build.
# The datapath clock: 200 MHz in the 2015 SUME tree (160 MHz in release 1.8; the paper's core ran at 180 MHz).
create_clock -name axis_aclk -period 5.000 [get_ports axis_aclk]
# Board clocks of the full SUME design, for a build inside the reference NIC project:
#   fpga_sysclk 5 ns, PCIe sys_clk 10 ns, xphy_refclk 6.4 ns (declared by nf_sume_general.xdc / nf_sume_10g.xdc there).
set_input_delay -clock axis_aclk 1.000 [get_ports -filter {DIRECTION == IN && NAME != axis_aclk}]
set_output_delay -clock axis_aclk 1.000 [get_ports -filter {DIRECTION == OUT}]

-- hypafilter_core: the hardware firewall core (AXI4-Stream in/out, AXI4-Lite registers); the top level that
-- the SUME wrapper and the Verilator emulator instantiate. Frames go into a packet FIFO while a copy of their
-- header runs through parser, generated matcher, priority encoder and table lookup; the output stage joins
-- each frame with its decision (DROP, FORWARD to the paired MAC, SHUNT to the host with metadata; in host mode,
-- CONTROL bit 3, a hardware ACCEPT goes to the host too, with metadata reason 5 "decided").
-- With a flow cache (FC_LOG2_SETS > 0) the parsed header is looked up in hf_flow_cache and waits its LATENCY
-- (4 cycles) before the matcher, which then sees the frame's ct: 0 unknown (miss, bypass, not TCP/UDP, unparsed),
-- 1 a hit in the flow's original direction, 2 a hit in its reply direction. CONTROL bits 4/5 shunt a frame with
-- ct = 0 whose decision is ACCEPT/DROP with reason 3 ("state unknown"). Host commands (FC_* registers) and the
-- FLOW_* tables of the indirect interface share the cache's command port.
-- Log mirroring: ACTION bit 3 marks an entry whose decided frames the host must also see (observing rules, LOG or
-- NFLOG): an ACCEPT goes to the paired MAC and, in the same output frame (two dst_port bits), to the ingress port's
-- DMA queue with metadata reason 4; a DROP goes to the DMA queue alone with reason 4; in host mode an ACCEPT is
-- delivered with reason 4 instead of 5. Shunting (shunt bit, non-decisive action, shunt everything, miss forcing)
-- takes precedence, and the metadata's action never carries the mirror bit.
-- Updates (SFL, ARCHITECTURE.md section 8): hf_update_buffer holds a valid mask the matcher ANDs with its entries
-- and BUF_DEPTH run-time slots; it turns the static encoder's index into the hardware index (a slot b that wins is
-- N_ENTRIES + 1 + b), which every table row, the hit counters and M[23:0] use. CONTROL bit 1 (shunt everything) is
-- sampled in every cycle from the matcher's input to the decision, so a frame is decided only under the tables,
-- mask and slots from before or from after a bracketed sequence of writes.
-- [ctm] New flows (CTM_LOG2 > 0, with a flow cache): hf_ct_member holds the canonical keys of every conntrack entry's
-- tuples (the flow sync service's inserts and deletes, table CTM_CMD) and the recent egress of the frames the host
-- sends out; while CTM_CONTROL's COMPLETE holds (and CTM_LEASE runs), a wire TCP/UDP frame that misses the flow cache
-- and is in neither gets ct 3 (no conntrack entry: NEW or INVALID to the kernel), decided with the SHUNT_NONE vector;
-- an ACCEPT of such a frame is forced to the host by CONTROL bit 4 (conntrack must create its entry). A wire TCP/UDP
-- frame handed to the host stamps its key (shunt stamps, written by the decision); a frame with ct 3 whose key went to
-- the host less than CTM_WINDOW ago goes to the host unjudged (reason 3, no index): the frame that went may make its
-- entry before the host sees it.
-- The policy sync lease (LEASE, hw/regmap.txt): while the host's policy sync service runs it re-arms a count of 1 ms
-- ticks; armed and run down it has expired, and the core then judges no wire frame (as with CONTROL bit 0 clear:
-- every one is shunted as unparsed with match_index 0xFFFFFF (no index: never the shim's live K0 tree), k = 0, so the
-- live ruleset decides it whole), until LEASE is written again. The
-- ticks come from a divider of axis_aclk (LEASE_TICK_CYCLES), or, with LEASE_TICK_CYCLES = 0, from the lease_ticks
-- input: the emulator, whose clock runs only while it works, gives there the milliseconds of wall time it owes.
-- Sets (issue #24, N_SET_SLOTS > 0): one hf_set_table per set slot looks the header up (SET_LATENCY cycles, the
-- header waits beside it) and gives the matcher h_sets; a lookup that rests on an uncertain element shunts the frame
-- with reason 3 and match_index 0xFFFFFF (no index: the shim gives it k = 0, the whole policy), counted in
-- CNT_SHUNT_STATE and CNT_SET_UNCERTAIN. Tables SET_* (IDs 8-11, index bits 22:20 = slot) go to the slot's unit.
-- Dual stack (issue #25, V6_ON from a plan6, docs/ipv6.md "The NIC's core"): the parser walks the IPv6 chain (a chain
-- with AH unparsed), the matcher's IPv6 entries match parsed IPv6 frames only (hardware indices V6_BASE.., the IPv6
-- policy entry V6_POLICY) and its IPv4 entries the other frames; the flow cache holds IPv6 tuples too (its generic
-- V6: 304-bit keys, table FLOW_KEY6, FC_KEY4..9), so a parsed IPv6 TCP/UDP frame of a cached flow has ct 1/2; the
-- conntrack membership structure takes IPv6 keys (its generic V6: folded addresses, CTM_CMD w3 bit 10; parsed IPv6
-- wire frames looked up, host frames stamped), so a parsed IPv6 TCP/UDP frame it does not hold has ct 3; the IPv6
-- plan's set slots have tables of their own (N_SET6_SLOTS hf_set_table with V6, tables SET6_* 18-21, h6_sets: an
-- IPv6 frame's set bits and its uncertainty come from them, an IPv4 frame's from the IPv4 slots); the IPv4 update
-- buffer's slots never match an IPv6
-- frame: hf_update_buffer6 (BUF6_DEPTH slots with raw 128-bit bounds, tables BUF6/VALID6) holds the IPv6 entries'
-- valid mask (VALID6, ANDed into the matcher's IPv6 entries) and the IPv6 slots, local indices N6_ENTRIES + 1 + b:
-- hardware index V6_POLICY + 1 + b (docs/ipv6.md "## emu", "The update buffer for IPv6 rules on the NIC").
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;
use work.hf_set_pkg.all;
use work.hf_policy_pkg.all;
use work.hf_regs_pkg.all;

entity hypafilter_core is
  generic (
    C_S_AXIS_DATA_WIDTH  : positive := 256;    -- TDATA bits: 256 (SUME) or 512 (NetFPGA-PLUS)
    C_S_AXIS_TUSER_WIDTH : positive := 128;    -- TUSER bits (SUME layout, 128)
    C_S_AXI_ADDR_WIDTH   : positive := 12;     -- AXI4-Lite address bits (4 KB window)
    C_FIFO_DEPTH_BYTES   : positive := 65536;  -- packet FIFO size; TDATA bytes times a power of two
    FC_LOG2_SETS         : natural := 0;       -- flow cache sets = 2**FC_LOG2_SETS; 0: no flow cache (ct always 0)
    FC_WAYS              : positive := 4;      -- flow cache ways (FC_WAYS * 2**FC_LOG2_SETS in 4,096..65,536)
    FC_TICK_CYCLES       : positive := 200000; -- clock cycles per flow cache timestamp tick (1 ms at 200 MHz)
    LEASE_TICK_CYCLES    : natural := 200000;  -- clock cycles per lease tick (1 ms at 200 MHz); 0: ticks from lease_ticks
    CTM_LOG2             : natural := 0;       -- [ctm] conntrack membership counters per bank = 2**CTM_LOG2; 0: none
    CTM_EGRESS_LOG2      : natural := 12       -- [ctm] recent-egress stamps = 2**CTM_EGRESS_LOG2
  );
  port (
    axis_aclk     : in  std_logic;
    axis_resetn   : in  std_logic;
    s_axis_tdata  : in  std_logic_vector(C_S_AXIS_DATA_WIDTH - 1 downto 0);
    s_axis_tkeep  : in  std_logic_vector(C_S_AXIS_DATA_WIDTH / 8 - 1 downto 0);
    s_axis_tuser  : in  std_logic_vector(C_S_AXIS_TUSER_WIDTH - 1 downto 0);
    s_axis_tvalid : in  std_logic;
    s_axis_tready : out std_logic;
    s_axis_tlast  : in  std_logic;
    m_axis_tdata  : out std_logic_vector(C_S_AXIS_DATA_WIDTH - 1 downto 0);
    m_axis_tkeep  : out std_logic_vector(C_S_AXIS_DATA_WIDTH / 8 - 1 downto 0);
    m_axis_tuser  : out std_logic_vector(C_S_AXIS_TUSER_WIDTH - 1 downto 0);
    m_axis_tvalid : out std_logic;
    m_axis_tready : in  std_logic;
    m_axis_tlast  : out std_logic;
    s_axi_awaddr  : in  std_logic_vector(C_S_AXI_ADDR_WIDTH - 1 downto 0);
    s_axi_awvalid : in  std_logic;
    s_axi_awready : out std_logic;
    s_axi_wdata   : in  std_logic_vector(31 downto 0);
    s_axi_wstrb   : in  std_logic_vector(3 downto 0);
    s_axi_wvalid  : in  std_logic;
    s_axi_wready  : out std_logic;
    s_axi_bresp   : out std_logic_vector(1 downto 0);
    s_axi_bvalid  : out std_logic;
    s_axi_bready  : in  std_logic;
    s_axi_araddr  : in  std_logic_vector(C_S_AXI_ADDR_WIDTH - 1 downto 0);
    s_axi_arvalid : in  std_logic;
    s_axi_arready : out std_logic;
    s_axi_rdata   : out std_logic_vector(31 downto 0);
    s_axi_rresp   : out std_logic_vector(1 downto 0);
    s_axi_rvalid  : out std_logic;
    s_axi_rready  : in  std_logic;
    -- lease ticks elapsed in this cycle, read only when LEASE_TICK_CYCLES = 0 (the emulator's wall-clock time base)
    lease_ticks   : in  std_logic_vector(31 downto 0) := (others => '0')
  );
end entity;

architecture rtl of hypafilter_core is
  constant DW : natural := C_S_AXIS_DATA_WIDTH;
  constant UW : natural := C_S_AXIS_TUSER_WIDTH;
  constant KW : natural := DW / 8;
  constant PKT_DEPTH : natural := C_FIFO_DEPTH_BYTES / KW;
  constant PW : natural := DW + KW + 1;      -- packet FIFO word: tdata, tkeep, tlast
  constant DECW : natural := 1 + EV_W + UW;  -- decision FIFO word: drop, events, tuser

  constant SIDE_DELAY : natural := MATCH_LATENCY + ENC_STAGES + BUF_LATENCY;
  constant FC_ON : boolean := FC_LOG2_SETS > 0;
  constant FC_TS_W : natural := 32;

  -- the parsed header (and the frame information with it), as the parser gives it and as the matcher takes it
  type hdr_t is record
    v     : std_logic;
    unp   : std_logic;
    unf   : std_logic;
    tu    : std_logic_vector(UW - 1 downto 0);
    src   : std_logic_vector(31 downto 0);
    dst   : std_logic_vector(31 downto 0);
    proto : std_logic_vector(7 downto 0);
    it    : std_logic_vector(7 downto 0);
    ic    : std_logic_vector(7 downto 0);
    flags : std_logic_vector(7 downto 0);
    sport : std_logic_vector(15 downto 0);
    dport : std_logic_vector(15 downto 0);
    iport : std_logic_vector(1 downto 0);
    l4ok  : std_logic;
    -- IPv6 (a dual-stack core, V6_ON): f6 '1' for an IPv6 frame the walk parsed (unp stays '1' for it: the set
    -- tables look up IPv4 frames only; the flow cache and the conntrack membership structure take f6 frames by their
    -- IPv6 fields), and its fields
    f6    : std_logic;
    src6, dst6 : std_logic_vector(127 downto 0);
    proto6, it6, ic6, flags6 : std_logic_vector(7 downto 0);
    sport6, dport6 : std_logic_vector(15 downto 0);
  end record;
  constant HDR_ZERO : hdr_t := ('0', '0', '0', (others => '0'), (others => '0'), (others => '0'), (others => '0'),
                                (others => '0'), (others => '0'), (others => '0'), (others => '0'),
                                (others => '0'), (others => '0'), '0',
                                '0', (others => '0'), (others => '0'), (others => '0'), (others => '0'),
                                (others => '0'), (others => '0'), (others => '0'), (others => '0'));
  signal hp, hq : hdr_t;
  signal q_ct : std_logic_vector(1 downto 0);
  -- after the set tables: the header the matcher takes, its ct, its set bits and whether they are uncertain
  signal hs : hdr_t;
  signal s_ct : std_logic_vector(1 downto 0);
  signal s_sets : std_logic_vector(SET_SLOTS - 1 downto 0);
  signal s6_sets : std_logic_vector(SET6_SLOTS - 1 downto 0);
  signal s_unc : std_logic;
  -- [ctm] the frame's TCP/UDP key and its stamp index, beside the header from the lookup to the decision
  signal q_ek, s_ek : std_logic;
  signal q_ei, s_ei : std_logic_vector(23 downto 0);
  signal set_tbl, set_ind_done : std_logic;
  signal set_ind_rdata : std_logic_vector(31 downto 0);

  type side_t is record
    v   : std_logic;
    unp : std_logic;
    unf : std_logic;  -- unfilterable by netfilter (two VLAN tags)
    ct  : std_logic_vector(1 downto 0);  -- flow-cache state: 0 unknown, 1 original direction, 2 reply
    sa  : std_logic;  -- CONTROL bit 1 (shunt everything) was set in some cycle since the header entered the matcher
    su  : std_logic;  -- a set lookup was uncertain
    tu  : std_logic_vector(UW - 1 downto 0);
    f6  : std_logic;  -- a parsed IPv6 frame (its index is an IPv6 entry's or the IPv6 policy entry)
    ek  : std_logic;  -- [ctm] a wire frame with a TCP/UDP key: ei is its shunt stamp's index
    ei  : std_logic_vector(23 downto 0);
  end record;
  type side_line is array (1 to SIDE_DELAY) of side_t;
  constant SIDE_ZERO : side_t := ('0', '0', '0', "00", '0', '0', (others => '0'), '0', '0', (others => '0'));
  signal side_in : side_t;
  signal side : side_line := (others => SIDE_ZERO);

  -- flow cache command port and the register side of it
  signal fc_cmd : std_logic;
  signal fc_op : std_logic_vector(2 downto 0);
  signal fc_key0, fc_key1, fc_key2, fc_key3 : std_logic_vector(31 downto 0);
  signal fc_key_hi : std_logic_vector(191 downto 0);
  signal fc_slot : std_logic_vector(23 downto 0);
  signal fc_status, fc_config, fc_now, fc_occ, fc_ins, fc_del, fc_full : std_logic_vector(31 downto 0);
  signal fc_tbl, tbl_req, tbl_done, fc_ind_done : std_logic;
  signal tbl_rdata, fc_ind_rdata : std_logic_vector(31 downto 0);

  signal rst : std_logic;
  signal accept, pkt_in_ready : std_logic;
  signal h_valid, h_unp, h_unf : std_logic;
  signal h_tuser : std_logic_vector(UW - 1 downto 0);
  signal h_src, h_dst : std_logic_vector(31 downto 0);
  signal h_proto, h_it, h_ic, h_flags : std_logic_vector(7 downto 0);
  signal h_l4ok : std_logic;
  signal h_sport, h_dport : std_logic_vector(15 downto 0);
  signal h_iport : std_logic_vector(1 downto 0);
  signal h_fam, h6_unp : std_logic;
  signal h6_src, h6_dst : std_logic_vector(127 downto 0);
  signal h6_proto, h6_it, h6_ic, h6_flags : std_logic_vector(7 downto 0);
  signal h6_sport, h6_dport : std_logic_vector(15 downto 0);
  signal h6_l4ok : std_logic;
  signal res : std_logic_vector(RES_WIDTH - 1 downto 0);
  signal valid_mask : std_logic_vector(VALID_WIDTH - 1 downto 0);
  signal st_idx : unsigned(IDX_W - 1 downto 0);  -- the static encoder's index (N_ENTRIES when none matched)
  signal ub_tbl, ub_req, ub_done : std_logic;
  signal ub_rdata : std_logic_vector(31 downto 0);
  -- the IPv6 update buffer (V6_ON): its valid mask, the static IPv6 index as a local one, its local index out
  signal valid6_mask : std_logic_vector(VALID6_WIDTH - 1 downto 0);
  signal st_idx6, idx6 : unsigned(IDX_W - 1 downto 0);
  signal lk_idx4 : unsigned(IDX_W - 1 downto 0);
  signal ub6_tbl, ub6_req, ub6_done : std_logic;
  signal ub6_rdata : std_logic_vector(31 downto 0);
  signal enc_any : std_logic;
  signal enc_idx : unsigned(IDX_W - 1 downto 0);
  signal lk_idx : unsigned(IDX_W - 1 downto 0);
  signal lk_shunt : std_logic;
  signal tbl_ready : std_logic;  -- tables hold the policy (reset sweep done)
  signal lk_action : std_logic_vector(3 downto 0);

  signal t1 : side_t := SIDE_ZERO;
  signal t1_idx : unsigned(IDX_W - 1 downto 0) := (others => '0');
  -- ct = 0 and CONTROL bit 4 (5), an IPv6 frame's bit 6 (7): registered here, off the decision's path
  signal t1_mfa, t1_mfd : std_logic := '0';
  signal d_in_v : std_logic := '0';
  signal d_in : std_logic_vector(DECW - 1 downto 0) := (others => '0');
  signal d_in_ready : std_logic;
  signal hit_v : std_logic := '0';
  signal hit_idx : unsigned(IDX_W - 1 downto 0) := (others => '0');

  signal generation : std_logic_vector(15 downto 0);
  signal control : std_logic_vector(31 downto 0);

  signal p_out : std_logic_vector(PW - 1 downto 0);
  signal p_valid, p_ready : std_logic;
  signal d_out : std_logic_vector(DECW - 1 downto 0);
  signal d_valid, d_ready : std_logic;
  signal ev_valid, ev_sent, fifo_drop : std_logic;
  signal ev_bits : std_logic_vector(EV_W - 1 downto 0);
  signal hits_clear, ind_req, ind_write, ind_done : std_logic;
  signal ind_addr, ind_wdata, ind_rdata : std_logic_vector(31 downto 0);
  signal lease_t : std_logic_vector(31 downto 0) := (others => '0');
  signal lease_expired : std_logic;
  -- [ctm] the conntrack membership structure's side of the core
  signal q_none : std_logic;  -- the header at the matcher has ct 3 (no conntrack entry)
  signal sh_bit, sn_bit : std_logic;  -- the shunt bit that counts for the frame at the decision; SHUNT_NONE's
  signal ctm_tbl, ctm_done : std_logic;
  signal ctm_rdata : std_logic_vector(31 downto 0);
  signal x_wr : std_logic;
  signal x_waddr : std_logic_vector(2 downto 0);
  signal x_wdata : std_logic_vector(31 downto 0);
  signal x_rdata : std_logic_vector(255 downto 0);
  -- [ctm] shunt stamps: the decision's write (a wire frame with a key handed to the host) and its read's answer
  signal sh_v_r : std_logic := '0';
  signal sh_i_r : std_logic_vector(23 downto 0) := (others => '0');
  signal ck_rec : std_logic;
begin
  assert C_S_AXIS_DATA_WIDTH = 256 or C_S_AXIS_DATA_WIDTH = 512
    report "hypafilter_core: C_S_AXIS_DATA_WIDTH must be 256 or 512" severity failure;
  assert C_S_AXIS_TUSER_WIDTH = 128 report "hypafilter_core: C_S_AXIS_TUSER_WIDTH must be 128" severity failure;
  assert C_FIFO_DEPTH_BYTES mod KW = 0 and 2 ** clog2(PKT_DEPTH) = PKT_DEPTH and PKT_DEPTH >= 4
    report "hypafilter_core: C_FIFO_DEPTH_BYTES must be TDATA bytes times a power of two (>= 4 beats)"
    severity failure;
  assert N_ROWS <= 2 ** 24 report "hypafilter_core: every hardware index must fit M[23:0]" severity failure;

  rst <= not axis_resetn;

  lease_ext : if LEASE_TICK_CYCLES = 0 generate
    lease_t <= lease_ticks;
  end generate;
  lease_div : if LEASE_TICK_CYCLES > 0 generate
    signal div : natural range 0 to LEASE_TICK_CYCLES - 1 := 0;
  begin
    divide : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        lease_t <= (others => '0');
        if div = LEASE_TICK_CYCLES - 1 then
          div <= 0;
          lease_t(0) <= '1';
        else
          div <= div + 1;
        end if;
        if rst = '1' then
          div <= 0;
        end if;
      end if;
    end process;
  end generate;

  accept <= s_axis_tvalid and pkt_in_ready;
  s_axis_tready <= pkt_in_ready;

  pkt_fifo : entity work.hf_fifo
    generic map (WIDTH => PW, DEPTH => PKT_DEPTH)
    port map (
      clk => axis_aclk, rst => rst,
      in_data => s_axis_tlast & s_axis_tkeep & s_axis_tdata, in_valid => s_axis_tvalid, in_ready => pkt_in_ready,
      out_data => p_out, out_valid => p_valid, out_ready => p_ready);

  -- the IPv6 walk only in a dual-stack core (V6_ON): in an IPv4-only core it is generated out and every IPv6 frame
  -- is h_unparsed (its logic made the post-synthesis simulations five times slower, docs/ipv6.md); a chain holding
  -- AH stays unparsed (V6_AH: nf_tables' -p stops at AH, legacy's steps over it)
  parser : entity work.hf_header_parser
    generic map (DATA_WIDTH => DW, TUSER_WIDTH => UW, V6_WALK => V6_ON, V6_AH => false)
    port map (
      clk => axis_aclk, rst => rst, beat_valid => accept,
      tdata => s_axis_tdata, tkeep => s_axis_tkeep, tlast => s_axis_tlast, tuser => s_axis_tuser,
      h_valid => h_valid, h_unparsed => h_unp, h_unfilterable => h_unf, h_tuser => h_tuser,
      h_src => h_src, h_dst => h_dst, h_proto => h_proto, h_sport => h_sport, h_dport => h_dport,
      h_icmp_type => h_it, h_icmp_code => h_ic, h_iport => h_iport, h_flags => h_flags,
      h_l4_ok => h_l4ok, h_family => h_fam, h6_unparsed => h6_unp, h6_src => h6_src, h6_dst => h6_dst,
      h6_hlim => open, h6_proto => h6_proto, h6_sport => h6_sport, h6_dport => h6_dport, h6_icmp_type => h6_it,
      h6_icmp_code => h6_ic, h6_flags => h6_flags, h6_l4_ok => h6_l4ok);

  hp <= (h_valid, h_unp, h_unf, h_tuser, h_src, h_dst, h_proto, h_it, h_ic, h_flags, h_sport, h_dport, h_iport, h_l4ok,
         h_fam and not h6_unp, h6_src, h6_dst, h6_proto, h6_it, h6_ic, h6_flags, h6_sport, h6_dport);

  no_cache : if not FC_ON generate
    hq <= hp;
    q_ct <= "00";
    fc_status <= (others => '0');
    fc_config <= (others => '0');
    fc_now <= (others => '0');
    fc_occ <= (others => '0');
    fc_ins <= (others => '0');
    fc_del <= (others => '0');
    fc_full <= (others => '0');
    -- the FLOW_* tables read 0; a write to them does nothing
    answer : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        fc_ind_done <= ind_req and fc_tbl and not rst;
      end if;
    end process;
    fc_ind_rdata <= (others => '0');
  end generate;

  with_cache : if FC_ON generate
    constant LAT : natural := 4;  -- hf_flow_cache's lookup latency (hypafilter.hw.flowcache.LATENCY)
    constant FKW : natural := fc_key_w(V6_ON);  -- the cache's key bits: 104, or 304 with IPv6 tuples
    constant LO_AT : natural := 72 + 96 * boolean'pos(V6_ON);  -- the lo address's bit 0 in the key
    signal lk_f6, lk_l4 : std_logic;
    signal lk_src, lk_dst : std_logic_vector(31 downto 0);
    signal lk_proto, lk_flags : std_logic_vector(7 downto 0);
    signal lk_sport, lk_dport : std_logic_vector(15 downto 0);
    signal p_khi : std_logic_vector(191 downto 0) := (others => '0');
    signal c_v6 : std_logic := '0';
    signal c_src_hi, c_dst_hi : std_logic_vector(95 downto 0) := (others => '0');
    signal k6_word : std_logic_vector(31 downto 0);  -- the FLOW_KEY6 word i_idx names, of the slot read
    type hdr_line is array (1 to LAT) of hdr_t;
    signal hl : hdr_line := (others => HDR_ZERO);
    signal sp : std_logic_vector(7 downto 0);
    signal lk_v, r_hit, r_dir : std_logic;
    -- command port: FC_CMD commands and FLOW_* table reads, one at a time (a read of a slot serves the tables)
    type arb_t is (A_IDLE, A_ISSUE, A_WAIT);
    signal arb : arb_t := A_IDLE;
    signal reg_pend, ind_pend, own_ind : std_logic := '0';
    signal p_op : std_logic_vector(2 downto 0) := (others => '0');
    signal p_k0, p_k1, p_k2, p_k3 : std_logic_vector(31 downto 0) := (others => '0');
    signal p_slot : std_logic_vector(23 downto 0) := (others => '0');
    signal i_tbl : std_logic_vector(7 downto 0) := (others => '0');
    signal i_idx : std_logic_vector(23 downto 0) := (others => '0');
    signal c_ready, r_valid, r_counted : std_logic;
    signal c_op : std_logic_vector(2 downto 0) := (others => '0');
    signal c_src, c_dst : std_logic_vector(31 downto 0) := (others => '0');
    signal c_proto : std_logic_vector(7 downto 0) := (others => '0');
    signal c_sport, c_dport : std_logic_vector(15 downto 0) := (others => '0');
    signal c_slot : std_logic_vector(23 downto 0) := (others => '0');
    signal c_v : std_logic := '0';
    signal r_status : std_logic_vector(3 downto 0);
    signal r_slot : std_logic_vector(23 downto 0);
    signal r_word : std_logic_vector(FKW + 2 downto 0);
    signal r_seen : std_logic_vector(FC_TS_W - 1 downto 0);
    signal r_hits : std_logic_vector(31 downto 0);
    signal stat : std_logic_vector(31 downto 0) := (others => '0');
    signal i_done : std_logic := '0';
    signal i_rdata : std_logic_vector(31 downto 0) := (others => '0');
  begin
    -- looked up: parsed TCP/UDP frames from a wire port (anything else has ct 0); in a dual-stack core a parsed
    -- IPv6 frame by its IPv6 fields (its unp stays '1')
    sp <= hp.tu(TUSER_SRC_LO + 7 downto TUSER_SRC_LO);
    lk_f6 <= hp.f6 and to_sl(V6_ON);
    lk_src <= hp.src6(31 downto 0) when lk_f6 = '1' else hp.src;
    lk_dst <= hp.dst6(31 downto 0) when lk_f6 = '1' else hp.dst;
    lk_proto <= hp.proto6 when lk_f6 = '1' else hp.proto;
    lk_flags <= hp.flags6 when lk_f6 = '1' else hp.flags;
    lk_sport <= hp.sport6 when lk_f6 = '1' else hp.sport;
    lk_dport <= hp.dport6 when lk_f6 = '1' else hp.dport;
    lk_l4 <= h6_l4ok when lk_f6 = '1' else hp.l4ok;
    lk_v <= hp.v and (not hp.unp or lk_f6) and not hp.unf
            and to_sl(sp = x"01" or sp = x"04" or sp = x"10" or sp = x"40")
            and to_sl(lk_proto = x"06" or lk_proto = x"11");

    cache : entity work.hf_flow_cache
      generic map (LOG2_SETS => FC_LOG2_SETS, WAYS => FC_WAYS, TS_W => FC_TS_W, TICK_CYCLES => FC_TICK_CYCLES,
                   V6 => V6_ON)
      port map (
        clk => axis_aclk, rst => rst,
        lk_valid => lk_v, lk_src_ip => lk_src, lk_dst_ip => lk_dst, lk_proto => lk_proto, lk_sport => lk_sport,
        lk_dport => lk_dport, lk_v6 => lk_f6, lk_src_hi => hp.src6(127 downto 32),
        lk_dst_hi => hp.dst6(127 downto 32), lk_tcp_flags => lk_flags, lk_l4_ok => lk_l4,
        res_valid => open, res_hit => r_hit, res_bypass => open, res_dir => r_dir, res_slot => open,
        h_valid => c_v, h_ready => c_ready, h_op => c_op, h_src_ip => c_src, h_dst_ip => c_dst, h_proto => c_proto,
        h_sport => c_sport, h_dport => c_dport, h_v6 => c_v6, h_src_hi => c_src_hi, h_dst_hi => c_dst_hi,
        h_slot => c_slot,
        r_valid => r_valid, r_status => r_status, r_slot => r_slot, r_word => r_word, r_counted => r_counted,
        r_seen => r_seen, r_hits => r_hits,
        now => fc_now, occupancy => fc_occ, cnt_inserts => fc_ins, cnt_deletes => fc_del, cnt_full => fc_full,
        cnt_clear => hits_clear, ready => open);

    -- the header waits for its lookup result: both reach the matcher in the same cycle
    delay : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        hl(1) <= hp;
        for i in 2 to LAT loop
          hl(i) <= hl(i - 1);
        end loop;
        if rst = '1' then
          for i in 1 to LAT loop
            hl(i).v <= '0';
          end loop;
        end if;
      end if;
    end process;
    hq <= hl(LAT);
    q_ct <= ('0' & '1') when r_hit = '1' and r_dir = '0' else
            ('1' & '0') when r_hit = '1' else
            ('1' & '1') when q_none = '1' else "00";

    arbiter : process (axis_aclk)
      variable slot : unsigned(23 downto 0);
      variable w3 : std_logic_vector(31 downto 0);
    begin
      if rising_edge(axis_aclk) then
        i_done <= '0';
        if fc_cmd = '1' then  -- hf_regs ignores FC_CMD while bit 31 (busy) is set
          reg_pend <= '1';
          stat(31) <= '1';
          p_op <= fc_op;
          p_k0 <= fc_key0;
          p_k1 <= fc_key1;
          p_k2 <= fc_key2;
          p_k3 <= fc_key3;
          p_khi <= fc_key_hi;
          p_slot <= fc_slot;
        end if;
        if ind_req = '1' and fc_tbl = '1' then
          if ind_write = '1' then
            i_done <= '1';  -- the FLOW_* tables are read-only: a write does nothing
            i_rdata <= (others => '0');
          else
            ind_pend <= '1';
            i_tbl <= ind_addr(31 downto 24);
            i_idx <= ind_addr(23 downto 0);
          end if;
        end if;
        case arb is
          when A_IDLE =>
            if reg_pend = '1' then
              reg_pend <= '0';
              own_ind <= '0';
              c_op <= p_op;
              c_src <= p_k0;
              c_dst <= p_k1;
              c_sport <= p_k2(31 downto 16);
              c_dport <= p_k2(15 downto 0);
              c_proto <= p_k3(7 downto 0);
              c_v6 <= p_k3(8);  -- an IPv6 key (a cache without IPv6 tuples answers it status 4)
              c_src_hi <= p_khi(95 downto 0);
              c_dst_hi <= p_khi(191 downto 96);
              c_slot <= p_slot;
              c_v <= '1';
              arb <= A_ISSUE;
            elsif ind_pend = '1' then
              ind_pend <= '0';
              own_ind <= '1';
              c_op <= "100";  -- read slot
              slot := unsigned(i_idx);
              if unsigned(i_tbl) = TABLE_FLOW_KEY then
                slot := shift_right(slot, 2);
              end if;
              if unsigned(i_tbl) = TABLE_FLOW_KEY6 then
                slot := shift_right(slot, 3);
              end if;
              c_slot <= std_logic_vector(slot);
              c_v <= '1';
              arb <= A_ISSUE;
            end if;
          when A_ISSUE =>
            if c_ready = '1' then  -- taken at this edge
              c_v <= '0';
              arb <= A_WAIT;
            end if;
          when A_WAIT =>
            if r_valid = '1' then
              arb <= A_IDLE;
              if own_ind = '0' then
                stat <= "0000" & r_status & r_slot;
              else
                i_done <= '1';
                if unsigned(i_tbl) = TABLE_FLOW_SEEN then
                  i_rdata <= std_logic_vector(resize(unsigned(r_seen), 32));
                elsif unsigned(i_tbl) = TABLE_FLOW_HITS then
                  i_rdata <= r_hits;
                elsif unsigned(i_tbl) = TABLE_FLOW_KEY6 then
                  i_rdata <= k6_word;
                elsif i_idx(1 downto 0) = "00" then
                  i_rdata <= r_word(LO_AT + 31 downto LO_AT);
                elsif i_idx(1 downto 0) = "01" then
                  i_rdata <= r_word(71 downto 40);
                elsif i_idx(1 downto 0) = "10" then
                  i_rdata <= r_word(39 downto 8);
                else
                  -- word 3 built bit by bit: GHDL 2.0's Verilog of the same concatenation inside a case branch
                  -- read back word 2 in the emulator (the VHDL netlist was right)
                  w3 := (others => '0');
                  w3(31) := r_word(FKW + 2);
                  w3(30) := r_counted;
                  if V6_ON then
                    w3(9) := r_word(FKW - 8);  -- an IPv6 entry (the family byte's bit 0)
                  end if;
                  w3(8) := r_word(FKW);
                  w3(7 downto 0) := r_word(7 downto 0);
                  i_rdata <= w3;
                end if;
              end if;
            end if;
        end case;
        if rst = '1' then
          arb <= A_IDLE;
          reg_pend <= '0';
          ind_pend <= '0';
          c_v <= '0';
          stat <= (others => '0');
          i_done <= '0';
        end if;
      end if;
    end process;
    -- FLOW_KEY6: the addresses' bits 127:32 of an IPv6 entry (its family byte set), else 0; 0 in an IPv4-only core
    key6 : if V6_ON generate
      process (all)
        variable n : natural range 0 to 7;
      begin
        n := to_integer(unsigned(i_idx(2 downto 0)));
        k6_word <= (others => '0');
        for i in 0 to 2 loop
          if n = i and r_word(FKW - 8) = '1' then
            k6_word <= r_word(LO_AT + 32 * i + 63 downto LO_AT + 32 * i + 32);
          end if;
          if n = i + 3 and r_word(FKW - 8) = '1' then
            k6_word <= r_word(32 * i + 103 downto 32 * i + 72);
          end if;
        end loop;
      end process;
    end generate;
    no_key6 : if not V6_ON generate
      k6_word <= (others => '0');
    end generate;
    fc_status <= stat;
    fc_config <= std_logic_vector(to_unsigned(FC_LOG2_SETS + 256 * FC_WAYS + 65536 * FC_TS_W
                                              + 16777216 * boolean'pos(V6_ON), 32));
    fc_ind_done <= i_done;
    fc_ind_rdata <= i_rdata;
  end generate;

  -- ---- set membership tables (issue #24) ----
  no_sets : if N_SET_SLOTS + N_SET6_SLOTS = 0 generate
    hs <= hq;
    s_ct <= q_ct;
    s_ek <= q_ek;
    s_ei <= q_ei;
    s_sets <= (others => '0');
    s6_sets <= (others => '0');
    s_unc <= '0';
    -- the SET_* tables read 0; a write to them does nothing
    answer : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        set_ind_done <= ind_req and set_tbl and not rst;
      end if;
    end process;
    set_ind_rdata <= (others => '0');
  end generate;

  with_sets : if N_SET_SLOTS + N_SET6_SLOTS > 0 generate
    constant NS : natural := N_SET_SLOTS + N_SET6_SLOTS;  -- units: the IPv4 slots, then the IPv6 slots
    type hdr_line is array (1 to SET_LATENCY) of hdr_t;
    type ct_line is array (1 to SET_LATENCY) of std_logic_vector(1 downto 0);
    type ei_line is array (1 to SET_LATENCY) of std_logic_vector(24 downto 0);
    signal el : ei_line := (others => (others => '0'));
    type word_arr is array (0 to NS - 1) of std_logic_vector(31 downto 0);
    signal hl : hdr_line := (others => HDR_ZERO);
    signal cl : ct_line := (others => "00");
    signal unc_v, done_v : std_logic_vector(NS - 1 downto 0);
    signal rd_v : word_arr;
    signal slot_req : std_logic_vector(NS - 1 downto 0);
    signal miss_done : std_logic := '0';
    signal tbl6 : std_logic;  -- the request is for a SET6_* table
    signal unc4, unc6 : std_logic;
  begin
    tbl6 <= to_sl(unsigned(ind_addr(31 downto 24)) >= TABLE_SET6_ELEM);
    slots : for i in 0 to N_SET_SLOTS - 1 generate
      slot_req(i) <= ind_req and set_tbl and not tbl6 and to_sl(unsigned(ind_addr(22 downto 20)) = i);
      unit : entity work.hf_set_table
        generic map (SETTYPE => SET_TYPE(i), ADDR_DIR => SET_ADDR_DIR(i), PORT_DIR => SET_PORT_DIR(i),
                     BANKS => SET_BANKS(i), LOG2_BUCKETS => SET_LOG2_BUCKETS(i), WAYS => SET_WAYS(i))
        port map (
          clk => axis_aclk, rst => rst, h_src => hq.src, h_dst => hq.dst, h_proto => hq.proto, h_sport => hq.sport,
          h_dport => hq.dport, h_icmp_type => hq.it, h_icmp_code => hq.ic, member => s_sets(i), unc => unc_v(i),
          ind_req => slot_req(i), ind_write => ind_write, ind_addr => ind_addr, ind_wdata => ind_wdata,
          ind_done => done_v(i), ind_rdata => rd_v(i));
    end generate;
    pad : if SET_SLOTS > N_SET_SLOTS generate
      s_sets(SET_SLOTS - 1 downto N_SET_SLOTS) <= (others => '0');
    end generate;
    -- the IPv6 slots look the parsed IPv6 fields up (a dual-stack core's); their answers count for IPv6 frames only
    slots6 : for i in 0 to N_SET6_SLOTS - 1 generate
      slot_req(N_SET_SLOTS + i) <= ind_req and set_tbl and tbl6 and to_sl(unsigned(ind_addr(22 downto 20)) = i);
      unit : entity work.hf_set_table
        generic map (SETTYPE => SET6_TYPE(i), ADDR_DIR => SET6_ADDR_DIR(i), PORT_DIR => SET6_PORT_DIR(i),
                     BANKS => SET6_BANKS(i), LOG2_BUCKETS => SET6_LOG2_BUCKETS(i), WAYS => SET6_WAYS(i), V6 => true)
        port map (
          clk => axis_aclk, rst => rst, h_src => hq.src6, h_dst => hq.dst6, h_proto => hq.proto6,
          h_sport => hq.sport6, h_dport => hq.dport6, h_icmp_type => hq.it6, h_icmp_code => hq.ic6,
          member => s6_sets(i), unc => unc_v(N_SET_SLOTS + i),
          ind_req => slot_req(N_SET_SLOTS + i), ind_write => ind_write, ind_addr => ind_addr, ind_wdata => ind_wdata,
          ind_done => done_v(N_SET_SLOTS + i), ind_rdata => rd_v(N_SET_SLOTS + i));
    end generate;
    pad6 : if SET6_SLOTS > N_SET6_SLOTS generate
      s6_sets(SET6_SLOTS - 1 downto N_SET6_SLOTS) <= (others => '0');
    end generate;
    any4 : if N_SET_SLOTS > 0 generate
      unc4 <= or unc_v(N_SET_SLOTS - 1 downto 0);
    end generate;
    none4 : if N_SET_SLOTS = 0 generate
      unc4 <= '0';
    end generate;
    any6 : if N_SET6_SLOTS > 0 generate
      unc6 <= or unc_v(NS - 1 downto N_SET_SLOTS);
    end generate;
    none6 : if N_SET6_SLOTS = 0 generate
      unc6 <= '0';
    end generate;
    -- an IPv6 frame's answer from the IPv6 slots, any other frame's from the IPv4 slots (side_in masks the IPv4
    -- slots' for a parsed IPv6 frame as before; in an IPv4-only core hs.f6 is '0')
    s_unc <= (unc4 and not hs.f6) or (unc6 and hs.f6);

    -- a slot without a table answers at once: writes do nothing, reads give 0
    miss : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        miss_done <= ind_req and set_tbl and not rst
                     and ((not tbl6 and to_sl(unsigned(ind_addr(22 downto 20)) >= N_SET_SLOTS))
                          or (tbl6 and to_sl(unsigned(ind_addr(22 downto 20)) >= N_SET6_SLOTS)));
      end if;
    end process;
    set_ind_done <= miss_done or (or done_v);
    reply : process (done_v, rd_v)
      variable r : std_logic_vector(31 downto 0);
    begin
      r := (others => '0');
      for i in 0 to NS - 1 loop
        if done_v(i) = '1' then
          r := r or rd_v(i);
        end if;
      end loop;
      set_ind_rdata <= r;
    end process;

    -- the header and its ct wait for the lookups: all reach the matcher in the same cycle
    delay : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        hl(1) <= hq;
        cl(1) <= q_ct;
        el(1) <= q_ek & q_ei;
        for i in 2 to SET_LATENCY loop
          hl(i) <= hl(i - 1);
          cl(i) <= cl(i - 1);
          el(i) <= el(i - 1);
        end loop;
        if rst = '1' then
          for i in 1 to SET_LATENCY loop
            hl(i).v <= '0';
          end loop;
        end if;
      end if;
    end process;
    hs <= hl(SET_LATENCY);
    s_ct <= cl(SET_LATENCY);
    s_ek <= el(SET_LATENCY)(24);
    s_ei <= el(SET_LATENCY)(23 downto 0);
  end generate;
  -- ---- end of the set membership tables ----

  matcher : entity work.hf_matcher
    port map (
      clk => axis_aclk, h_src => hs.src, h_dst => hs.dst, h_proto => hs.proto, h_sport => hs.sport,
      h_dport => hs.dport, h_icmp_type => hs.it, h_icmp_code => hs.ic, h_iport => hs.iport, h_flags => hs.flags,
      h_ct => s_ct, h_sets => s_sets, h_f6 => hs.f6, h6_src => hs.src6, h6_dst => hs.dst6, h6_proto => hs.proto6,
      h6_sport => hs.sport6, h6_dport => hs.dport6, h6_icmp_type => hs.it6, h6_icmp_code => hs.ic6,
      h6_flags => hs.flags6, h6_sets => s6_sets, valid => valid_mask, valid6 => valid6_mask, res => res);

  encoder : entity work.hf_prio_enc
    generic map (N_IN => RES_WIDTH, FANIN => ENC_FANIN, STAGES => ENC_STAGES, IDX_W => IDX_W)
    port map (clk => axis_aclk, vec => res, any => enc_any, idx => enc_idx);

  -- no entry matched: the policy entry of the frame's family (the IPv6 one after the IPv6 entries)
  st_idx <= enc_idx when enc_any = '1' else
            to_unsigned(V6_POLICY, IDX_W) when V6_ON and side(MATCH_LATENCY + ENC_STAGES).f6 = '1' else
            to_unsigned(N_ENTRIES, IDX_W);

  -- the valid mask and the buffer slots: the header enters with the matcher's, the hardware index comes out
  -- BUF_LATENCY cycles after the static index
  ub : entity work.hf_update_buffer
    generic map (N_STATIC => N_ENTRIES, DEPTH => BUF_DEPTH, IDX_W => IDX_W, I_DELAY => MATCH_LATENCY + ENC_STAGES,
                 FANIN => BUF_FANIN, STAGES => BUF_STAGES)
    port map (
      clk => axis_aclk, rst => rst, h_src => hs.src, h_dst => hs.dst, h_proto => hs.proto, h_sport => hs.sport,
      h_dport => hs.dport, h_icmp_type => hs.it, h_icmp_code => hs.ic, h_iport => hs.iport, h_ct => s_ct,
      h_flags => hs.flags, h_sets => std_logic_vector(resize(unsigned(s_sets), 8)), h_on => not hs.f6,
      valid => valid_mask, st_idx => st_idx, idx => lk_idx4,
      ind_req => ub_req, ind_write => ind_write, ind_addr => ind_addr, ind_wdata => ind_wdata,
      ind_done => ub_done, ind_rdata => ub_rdata);

  -- a dual-stack core's IPv6 update buffer: the same pipeline position, the frame's local IPv6 index (its static
  -- entry's, or N6_ENTRIES for the IPv6 policy entry) in, the hardware index V6_BASE + local out
  buf6 : if V6_ON generate
    signal i6 : unsigned(IDX_W - 1 downto 0);
  begin
    assert BUF6_DEPTH = 0 or BUF_DEPTH > 0
      report "hypafilter_core: the IPv6 update buffer's latency must be the IPv4 buffer's" severity failure;
    st_idx6 <= enc_idx - to_unsigned(V6_BASE, IDX_W) when enc_any = '1' else to_unsigned(N6_ENTRIES, IDX_W);
    ub6 : entity work.hf_update_buffer6
      generic map (N_STATIC => N6_ENTRIES, DEPTH => BUF6_DEPTH, IDX_W => IDX_W, I_DELAY => MATCH_LATENCY + ENC_STAGES,
                   FANIN => BUF_FANIN, STAGES => BUF_STAGES, T_BUF => TABLE_BUF6)
      port map (
        clk => axis_aclk, rst => rst, h_src => hs.src6, h_dst => hs.dst6, h_proto => hs.proto6, h_sport => hs.sport6,
        h_dport => hs.dport6, h_icmp_type => hs.it6, h_icmp_code => hs.ic6, h_iport => hs.iport, h_ct => s_ct,
        h_flags => hs.flags6, h_sets => std_logic_vector(resize(unsigned(s6_sets), 8)), h_on => hs.f6,
        valid => valid6_mask, st_idx => st_idx6, idx => i6,
        ind_req => ub6_req, ind_write => ind_write, ind_addr => ind_addr, ind_wdata => ind_wdata,
        ind_done => ub6_done, ind_rdata => ub6_rdata);
    -- without IPv6 slots the index passes at once: it waits the IPv4 buffer's latency here
    slots6 : if BUF6_DEPTH > 0 or BUF_LATENCY = 0 generate
      idx6 <= i6;
    end generate;
    wait6 : if BUF6_DEPTH = 0 and BUF_LATENCY > 0 generate
      type idx_line is array (1 to BUF_LATENCY) of unsigned(IDX_W - 1 downto 0);
      signal l : idx_line := (others => (others => '0'));
    begin
      line6 : process (axis_aclk)
      begin
        if rising_edge(axis_aclk) then
          l(1) <= i6;
          for k in 2 to BUF_LATENCY loop
            l(k) <= l(k - 1);
          end loop;
        end if;
      end process;
      idx6 <= l(BUF_LATENCY);
    end generate;
    ub6_req <= ind_req and ub6_tbl;
  end generate;
  no_buf6 : if not V6_ON generate
    valid6_mask <= (others => '1');
    st_idx6 <= (others => '0');
    idx6 <= (others => '0');
    ub6_req <= '0';
    ub6_done <= '0';
    ub6_rdata <= (others => '0');
  end generate;
  lk_idx <= idx6 + to_unsigned(V6_BASE, IDX_W) when V6_ON and side(SIDE_DELAY).f6 = '1' else lk_idx4;

  -- frame information travelling beside matcher, encoder and buffer
  -- a parsed IPv6 frame is classified (its set bits and their uncertainty are the IPv6 slots': s_unc)
  side_in <= (hs.v, hs.unp and not hs.f6, hs.unf, s_ct, control(1), s_unc, hs.tu, hs.f6, s_ek, s_ei);
  side_shift : process (axis_aclk)
  begin
    if rising_edge(axis_aclk) then
      side(1) <= side_in;
      for i in 2 to SIDE_DELAY loop
        side(i) <= side(i - 1);
        side(i).sa <= side(i - 1).sa or control(1);
      end loop;
      if rst = '1' then
        for i in 1 to SIDE_DELAY loop
          side(i).v <= '0';
        end loop;
      end if;
    end if;
  end process;

  -- indirect accesses to the FLOW_* tables go to the flow cache's command port, VALID and BUF to the update buffer,
  -- the others to hf_tables
  fc_tbl <= '1' when unsigned(ind_addr(31 downto 24)) = TABLE_FLOW_KEY
                  or unsigned(ind_addr(31 downto 24)) = TABLE_FLOW_KEY6
                  or unsigned(ind_addr(31 downto 24)) = TABLE_FLOW_SEEN
                  or unsigned(ind_addr(31 downto 24)) = TABLE_FLOW_HITS else '0';
  ctm_tbl <= '1' when unsigned(ind_addr(31 downto 24)) = TABLE_SHUNT_NONE
                   or unsigned(ind_addr(31 downto 24)) = TABLE_CTM_CMD else '0';
  ub_tbl <= '1' when unsigned(ind_addr(31 downto 24)) = TABLE_VALID
                  or unsigned(ind_addr(31 downto 24)) = TABLE_BUF else '0';
  ub6_tbl <= '1' when V6_ON and (unsigned(ind_addr(31 downto 24)) = TABLE_VALID6
                                 or unsigned(ind_addr(31 downto 24)) = TABLE_BUF6) else '0';
  set_tbl <= '1' when (unsigned(ind_addr(31 downto 24)) >= TABLE_SET_ELEM
                        and unsigned(ind_addr(31 downto 24)) <= TABLE_SET_CTL)
                       or (unsigned(ind_addr(31 downto 24)) >= TABLE_SET6_ELEM
                           and unsigned(ind_addr(31 downto 24)) <= TABLE_SET6_CTL) else '0';
  ub_req <= ind_req and ub_tbl;
  tbl_req <= ind_req and not fc_tbl and not ub_tbl and not ub6_tbl and not set_tbl and not ctm_tbl;
  ind_done <= tbl_done or fc_ind_done or ub_done or ub6_done or set_ind_done or ctm_done;
  ind_rdata <= fc_ind_rdata when fc_ind_done = '1' else ub_rdata when ub_done = '1' else
               ub6_rdata when ub6_done = '1' else
               set_ind_rdata when set_ind_done = '1' else ctm_rdata when ctm_done = '1' else tbl_rdata;

  tables : entity work.hf_tables
    port map (
      clk => axis_aclk, rst => rst, lk_idx => lk_idx, lk_shunt => lk_shunt, lk_action => lk_action,
      hit_v => hit_v, hit_idx => hit_idx, hits_clear => hits_clear,
      ind_req => tbl_req, ind_write => ind_write, ind_addr => ind_addr, ind_wdata => ind_wdata,
      ind_done => tbl_done, ind_rdata => tbl_rdata, ready => tbl_ready);

  decide : process (axis_aclk)
    variable sp : std_logic_vector(7 downto 0);
    variable wire, host, judge, classify, shunt, drop, deliver, mirror, late : boolean;
    variable ev : std_logic_vector(EV_W - 1 downto 0);
    variable tu : std_logic_vector(UW - 1 downto 0);
    variable dst : std_logic_vector(7 downto 0);
    variable reason, action : std_logic_vector(3 downto 0);
    variable idx : unsigned(23 downto 0);
  begin
    if rising_edge(axis_aclk) then
      t1 <= side(SIDE_DELAY);
      t1.sa <= side(SIDE_DELAY).sa or control(1);
      t1_idx <= lk_idx;
      -- ct 3 (no conntrack entry) accepted: to the host all the same, conntrack must create the entry ([ctm])
      -- an IPv6 frame the flow cache does not know (ct 0, or ct 3 accepted) by the IPv6 side's own bits 6/7, so
      -- that one family's conntrack-reading policy does not send the other family's frames to the host
      if side(SIDE_DELAY).f6 = '1' then
        t1_mfa <= to_sl(side(SIDE_DELAY).ct = "00" or side(SIDE_DELAY).ct = "11") and control(6);
        t1_mfd <= to_sl(side(SIDE_DELAY).ct = "00") and control(7);
      else
        t1_mfa <= to_sl(side(SIDE_DELAY).ct = "00" or side(SIDE_DELAY).ct = "11") and control(4);
        t1_mfd <= to_sl(side(SIDE_DELAY).ct = "00") and control(5);
      end if;

      sp := t1.tu(TUSER_SRC_LO + 7 downto TUSER_SRC_LO);
      wire := sp = x"01" or sp = x"04" or sp = x"10" or sp = x"40";
      host := sp = x"02" or sp = x"08" or sp = x"20" or sp = x"80";
      -- until the tables hold the policy, and while the policy sync lease has expired, nothing is judged here: wire
      -- frames go to netfilter as unparsed
      judge := wire and control(0) = '1' and tbl_ready = '1' and lease_expired = '0';
      classify := judge and t1.unp = '0';
      -- [ctm] a frame with ct 3 whose key went to the host less than CTM_WINDOW ago (a shunt stamp: the decisions of
      -- this cycle's frame's predecessors, the one just before through sh_v_r): the frame that went may create the
      -- entry this one belongs to before the host sees this one, so "no entry" is not known
      late := t1.ct = "11" and t1.ek = '1' and (ck_rec = '1' or (sh_v_r = '1' and sh_i_r = t1.ei));
      ev := (others => '0');
      shunt := false;
      drop := false;
      deliver := false;
      dst := (others => '0');
      idx := resize(t1_idx, 24);
      mirror := lk_action(3) = '1';
      action := '0' & lk_action(2 downto 0);
      reason := REASON_OVERRULE;
      if t1_idx = N_ENTRIES or (V6_ON and t1_idx = V6_POLICY) then
        reason := REASON_POLICY;
      end if;
      if host then
        dst := '0' & sp(7 downto 1);
        ev(EV_FROM_HOST) := '1';
      elsif not wire then
        drop := true;  -- not a port of this datapath
      elsif judge and t1.unf = '1' and control(2) = '0' then
        drop := true;  -- netfilter would not filter it: dropped unless PASS_UNFILTERABLE hands it to the host bridge
        ev(EV_UNFILTERABLE) := '1';
      elsif not classify then
        shunt := true;
        idx := to_unsigned(N_ENTRIES, 24);
        if not judge then
          -- not judged (CONTROL bit 0 clear, tables sweeping, the lease expired): no index, so the shim can tell it
          -- from a frame judged unparsed while the core vouched for its tables (the live K0 tree, docs/shim.md)
          idx := (others => '1');
        end if;
        action := x"0";
        reason := REASON_UNPARSED;
        ev(EV_UNPARSED) := '1';
      elsif t1.su = '1' then
        -- a set lookup rests on an uncertain element: the set bits, so the index, may be wrong; no index (k = 0)
        shunt := true;
        idx := (others => '1');
        action := x"0";
        reason := REASON_STATE;
        ev(EV_STATE) := '1';
        ev(EV_SET_UNC) := '1';
      elsif late then
        -- [ctm] ct 3 while a frame of the same key is on its way through the host: state unknown, no index (k = 0:
        -- the whole policy decides with conntrack's own state)
        shunt := true;
        idx := (others => '1');
        action := x"0";
        reason := REASON_STATE;
        ev(EV_STATE) := '1';
      elsif sh_bit = '1' or (action /= x"1" and action /= x"2") or control(1) = '1' or t1.sa = '1' then
        shunt := true;
        if reason = REASON_POLICY then
          ev(EV_POLICY) := '1';
        else
          ev(EV_OVERRULE) := '1';
        end if;
        if sh_bit = '0' and (action = x"1" or action = x"2") then
          ev(EV_FORCED) := '1';
        end if;
      elsif (action = x"1" and t1_mfa = '1') or (action = x"2" and t1_mfd = '1') then
        -- a flow-cache miss whose verdict conntrack must see (MISS_SHUNT_ACCEPT / MISS_SHUNT_DROP): to the host,
        -- with the entry's match_index and action as for any shunt
        shunt := true;
        reason := REASON_STATE;
        ev(EV_STATE) := '1';
      elsif action = x"1" and control(3) = '1' then
        -- host mode: the verdict is final; the frame goes to the ingress port's DMA queue, as a shunt does
        -- (reason 4 when mirrored: the host runs the observing rules before it delivers the frame)
        ev(EV_FORWARDED) := '1';
        deliver := true;
        reason := REASON_DECIDED;
        if mirror then
          reason := REASON_MIRROR;
          ev(EV_MIRROR) := '1';
        end if;
      elsif action = x"1" then
        ev(EV_FORWARDED) := '1';
        -- ifs, not a case: GHDL 2.0's Verilog drops a case's `when others` (MAC3 here; hf_header_parser's iport)
        dst := x"10";
        if sp = x"01" then
          dst := x"04";
        end if;
        if sp = x"04" then
          dst := x"01";
        end if;
        if sp = x"10" then
          dst := x"40";
        end if;
        if mirror then
          -- also a copy to the ingress port's DMA queue: SUME's output queues (and the emulator) deliver the frame
          -- to every dst_port bit; only the DMA copy carries M (a MAC sends no TUSER)
          deliver := true;
          reason := REASON_MIRROR;
          ev(EV_MIRROR) := '1';
        end if;
      elsif mirror then
        -- a mirrored DROP: nothing on the wire, the copy to the ingress port's DMA queue
        ev(EV_DROPPED) := '1';
        ev(EV_MIRROR) := '1';
        deliver := true;
        reason := REASON_MIRROR;
      else
        drop := true;
        ev(EV_DROPPED) := '1';
      end if;
      if wire then
        ev(EV_WIRE) := '1';
      end if;
      tu := t1.tu;
      if shunt or deliver then
        dst := dst or (sp(6 downto 0) & '0');
        tu(TUSER_META_LO + 63 downto TUSER_META_LO) := META_MAGIC & generation & reason & action & std_logic_vector(idx);
      end if;
      tu(TUSER_DST_LO + 7 downto TUSER_DST_LO) := dst;
      d_in_v <= t1.v;
      d_in <= to_sl(drop) & ev & tu;
      hit_v <= t1.v and to_sl(classify) and not t1.su and to_sl(not late);
      hit_idx <= t1_idx;
      -- [ctm] a wire frame with a TCP/UDP key handed to the host stamps its key (hf_ct_member's shunt stamps)
      sh_v_r <= t1.v and t1.ek and to_sl(wire and (shunt or deliver));
      sh_i_r <= t1.ei;
      if rst = '1' then
        t1.v <= '0';
        d_in_v <= '0';
        hit_v <= '0';
        sh_v_r <= '0';
      end if;
    end if;
  end process;

  fifo_drop <= d_in_v and not d_in_ready;

  dec_fifo : entity work.hf_fifo
    generic map (WIDTH => DECW, DEPTH => PKT_DEPTH)
    port map (
      clk => axis_aclk, rst => rst, in_data => d_in, in_valid => d_in_v, in_ready => d_in_ready,
      out_data => d_out, out_valid => d_valid, out_ready => d_ready);

  out_stage : entity work.hf_output
    generic map (DATA_WIDTH => DW, TUSER_WIDTH => UW)
    port map (
      clk => axis_aclk, rst => rst,
      p_data => p_out(DW - 1 downto 0), p_keep => p_out(DW + KW - 1 downto DW), p_last => p_out(PW - 1),
      p_valid => p_valid, p_ready => p_ready,
      d_drop => d_out(DECW - 1), d_events => d_out(DECW - 2 downto UW), d_tuser => d_out(UW - 1 downto 0),
      d_valid => d_valid, d_ready => d_ready,
      m_axis_tdata => m_axis_tdata, m_axis_tkeep => m_axis_tkeep, m_axis_tuser => m_axis_tuser,
      m_axis_tvalid => m_axis_tvalid, m_axis_tready => m_axis_tready, m_axis_tlast => m_axis_tlast,
      ev_valid => ev_valid, ev_bits => ev_bits, ev_sent => ev_sent);

  regs : entity work.hf_regs
    generic map (ADDR_WIDTH => C_S_AXI_ADDR_WIDTH)
    port map (
      clk => axis_aclk, rst => rst,
      s_axi_awaddr => s_axi_awaddr, s_axi_awvalid => s_axi_awvalid, s_axi_awready => s_axi_awready,
      s_axi_wdata => s_axi_wdata, s_axi_wstrb => s_axi_wstrb, s_axi_wvalid => s_axi_wvalid,
      s_axi_wready => s_axi_wready, s_axi_bresp => s_axi_bresp, s_axi_bvalid => s_axi_bvalid,
      s_axi_bready => s_axi_bready, s_axi_araddr => s_axi_araddr, s_axi_arvalid => s_axi_arvalid,
      s_axi_arready => s_axi_arready, s_axi_rdata => s_axi_rdata, s_axi_rresp => s_axi_rresp,
      s_axi_rvalid => s_axi_rvalid, s_axi_rready => s_axi_rready,
      generation => generation, control => control,
      ev_valid => ev_valid, ev_bits => ev_bits, ev_sent => ev_sent, ev_fifo_drop => fifo_drop,
      hits_clear => hits_clear, ind_req => ind_req, ind_write => ind_write, ind_addr => ind_addr,
      ind_wdata => ind_wdata, ind_done => ind_done, ind_rdata => ind_rdata,
      fc_cmd => fc_cmd, fc_op => fc_op, fc_key0 => fc_key0, fc_key1 => fc_key1, fc_key2 => fc_key2,
      fc_key3 => fc_key3, fc_key_hi => fc_key_hi, fc_slot => fc_slot, fc_status => fc_status, fc_config => fc_config, fc_now => fc_now,
      fc_occupancy => fc_occ, fc_inserts => fc_ins, fc_deletes => fc_del, fc_full => fc_full,
      lease_ticks => lease_t, lease_expired => lease_expired,
      x_wr => x_wr, x_waddr => x_waddr, x_wdata => x_wdata, x_rdata => x_rdata);

  -- [ctm] ---------------------------------------------------------------- the conntrack membership structure
  sh_bit <= sn_bit when t1.ct = "11" else lk_shunt;

  no_ctm : if CTM_LOG2 = 0 generate
    q_none <= '0';
    q_ek <= '0';
    q_ei <= (others => '0');
    ck_rec <= '0';
    sn_bit <= lk_shunt;
    x_rdata <= (others => '0');
    ctm_rdata <= (others => '0');
    -- SHUNT_NONE and CTM_CMD read 0; a write does nothing
    answer : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        ctm_done <= ind_req and ctm_tbl and not rst;
      end if;
    end process;
  end generate;

  with_ctm : if CTM_LOG2 > 0 generate
    constant SNW : natural := maximum(1, clog2(SHUNT_WORDS));
    signal hp_wire, hp_host : std_logic;
    signal m_valid, m_member, m_egress, m_ready, m_h_ready, m_h_valid : std_logic;
    signal m_eidx : std_logic_vector(23 downto 0);
    signal p_ek : std_logic;
    signal ek_d : std_logic_vector(3 downto 0) := (others => '0');  -- p_ek beside the lookup (hf_ct_member LATENCY)
    signal m_members, m_sat, m_ref : std_logic_vector(31 downto 0);
    signal c_w0, c_w1, c_w2 : std_logic_vector(31 downto 0) := (others => '0');
    signal c_op : std_logic_vector(1 downto 0) := (others => '0');
    signal c_proto : std_logic_vector(7 downto 0) := (others => '0');
    signal c_pend, c_hv : std_logic := '0';
    signal c_v6 : std_logic := '0';
    -- the header the structure takes: an IPv6 frame's (a dual-stack core) by its IPv6 fields
    signal m_f6, m_a6, m_lk4, m_lk6, m_eg, m_u6 : std_logic;
    signal m_src, m_dst : std_logic_vector(31 downto 0);
    signal m_proto : std_logic_vector(7 downto 0);
    signal m_sport, m_dport : std_logic_vector(15 downto 0);
    signal r_complete : std_logic := '0';
    signal r_lease : unsigned(31 downto 0) := (others => '0');
    signal r_window : std_logic_vector(15 downto 0) := REG_CTM_WINDOW_RESET(15 downto 0);
    signal complete : std_logic := '0';  -- COMPLETE and the lease running (registered)
    signal n_none : unsigned(31 downto 0) := (others => '0');
    -- SHUNT_NONE: a RAM of packed words (lookup port, host port), all ones after the reset sweep
    signal sn_we : std_logic;
    signal sn_waddr : unsigned(SNW - 1 downto 0);
    signal sn_wdata : std_logic_vector(31 downto 0);
    signal sn_q : std_logic_vector(63 downto 0);
    signal sn_sel : unsigned(4 downto 0) := (others => '0');
    signal sw_busy : std_logic := '1';
    signal sw_idx : unsigned(SNW - 1 downto 0) := (others => '0');
    signal i_we, i_rd, i_rd2, i_done : std_logic := '0';
    signal i_addr : unsigned(SNW - 1 downto 0) := (others => '0');
    signal i_data, i_rdata : std_logic_vector(31 downto 0) := (others => '0');
  begin
    assert FC_ON report "hypafilter_core: CTM_LOG2 > 0 needs a flow cache (FC_LOG2_SETS > 0)" severity failure;

    hp_wire <= to_sl((hp.tu(TUSER_SRC_LO + 7 downto TUSER_SRC_LO) and x"55") /= x"00");
    hp_host <= to_sl((hp.tu(TUSER_SRC_LO + 7 downto TUSER_SRC_LO) and x"AA") /= x"00");
    -- looked up: parsed TCP/UDP wire frames (IPv6: the walk parsed it, its layer 4 whole, not double tagged)
    m_f6 <= hp.f6 and to_sl(V6_ON);
    m_lk4 <= not hp.unp;
    m_lk6 <= m_f6 and h6_l4ok and not hp.unf and to_sl(hp.proto6 = x"06" or hp.proto6 = x"11");
    -- an IPv6 frame's addresses (fixed header) even when the walk refused it: an m_u6 frame's stamp is of its pair
    m_a6 <= h_fam and to_sl(V6_ON);
    m_src <= hp.src6(31 downto 0) when m_a6 = '1' else hp.src;
    m_dst <= hp.dst6(31 downto 0) when m_a6 = '1' else hp.dst;
    m_proto <= hp.proto6 when m_f6 = '1' else hp.proto;
    m_sport <= hp.sport6 when m_f6 = '1' else hp.sport;
    m_dport <= hp.dport6 when m_f6 = '1' else hp.dport;
    -- stamped: every host frame whose protocol field says TCP or UDP, parsed or not: a connection's first frame out
    -- may be one the parser refuses (a fragment, options, padding after the datagram), and its header fields are
    -- there all the same (anything else it stamps is a false positive); a parsed IPv6 one by its IPv6 fields. An
    -- IPv6 host frame whose ports the walk does not give (refused, or its TCP/UDP header cut) stamps "unknown" for its
    -- address pair: no IPv6 frame between the same two addresses is NEW for a window after it. So does such a wire
    -- frame: it has no key, so no shunt stamp, yet the walk's refusal hands it to the host (unparsed) and conntrack
    -- may make its entry from it (ipv6_skip_exthdr walks any chain), before a reply right behind it is decided; one
    -- header per cycle, so the two sides never write the stamps in the same cycle (a wire frame dropped as
    -- unfilterable stamps too: a false positive)
    m_eg <= hp.v and hp_host and (to_sl(hp.proto = x"06" or hp.proto = x"11")
                                  or (m_f6 and to_sl(hp.proto6 = x"06" or hp.proto6 = x"11")));
    m_u6 <= hp.v and (hp_host or hp_wire) and to_sl(V6_ON) and h_fam
            and (h6_unp or (not h6_l4ok and to_sl(hp.proto6 = x"06" or hp.proto6 = x"11")));
    member : entity work.hf_ct_member
      generic map (LOG2 => CTM_LOG2, EGRESS_LOG2 => CTM_EGRESS_LOG2, V6 => V6_ON)
      port map (
        clk => axis_aclk, rst => rst,
        lk_valid => hp.v and hp_wire and (m_lk4 or m_lk6),
        eg_valid => m_eg,
        lk_src_ip => m_src, lk_dst_ip => m_dst, lk_proto => m_proto, lk_sport => m_sport, lk_dport => m_dport,
        lk_v6 => m_f6, lk_src_hi => hp.src6(127 downto 32), lk_dst_hi => hp.dst6(127 downto 32), eg_u6 => m_u6,
        res_valid => m_valid, res_member => m_member, res_egress => m_egress, res_eidx => m_eidx,
        sh_valid => sh_v_r, sh_idx => sh_i_r, ck_idx => side(SIDE_DELAY).ei, ck_recent => ck_rec,
        ticks => lease_t, window => r_window,
        h_valid => c_hv, h_ready => m_h_ready, h_op => c_op, h_src_ip => c_w0, h_dst_ip => c_w1, h_proto => c_proto,
        h_sport => c_w2(31 downto 16), h_dport => c_w2(15 downto 0), h_v6 => c_v6,
        members => m_members, saturated => m_sat, refused => m_ref, ready => m_ready);

    -- the lookup's answer reaches the matcher with its header (both LATENCY = 4 after the parser); an IPv6 frame was
    -- looked up only when it could be NEW (m_lk6)
    q_none <= complete and m_valid and not m_member
              and ((not hq.unp and hq.l4ok and to_sl(hq.proto = x"06" or hq.proto = x"11")) or (hq.f6 and to_sl(V6_ON)));
    -- a wire frame with a key: an IPv4 one whose protocol says TCP or UDP, parsed or not (its fields are read all the
    -- same, as a host frame's egress stamp), or a parsed IPv6 TCP/UDP frame; handed to the host, it stamps its key (the
    -- lookup's stamp index, which comes with the lookup's result)
    p_ek <= hp.v and hp_wire and ((not h_fam and to_sl(hp.proto = x"06" or hp.proto = x"11"))
                                  or (m_f6 and to_sl(hp.proto6 = x"06" or hp.proto6 = x"11")));
    ek_line : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        ek_d <= ek_d(ek_d'high - 1 downto 0) & p_ek;
        if rst = '1' then
          ek_d <= (others => '0');
        end if;
      end if;
    end process;
    q_ek <= ek_d(ek_d'high);
    q_ei <= m_eidx;

    regs_and_commands : process (axis_aclk)
      variable idx : unsigned(23 downto 0);
    begin
      if rising_edge(axis_aclk) then
        -- the lease runs down with the policy sync lease's time base; at 0 COMPLETE no longer counts, and clears
        if r_lease > unsigned(lease_t) then
          r_lease <= r_lease - unsigned(lease_t);
        else
          r_lease <= (others => '0');
          if r_lease /= 0 then
            r_complete <= '0';
          end if;
        end if;
        if lease_expired = '1' then
          r_complete <= '0';
        end if;
        -- an `if` per register, not a case with `others => null`: GHDL 2.0's Verilog drops `others`, a latch in the
        -- emulator's model (a write of a read-only CTM register loaded these with stale values; hf_regs.vhd)
        if x_wr = '1' and x_waddr = "000" then
          r_complete <= x_wdata(0);
        end if;
        if x_wr = '1' and x_waddr = "001" then
          r_lease <= unsigned(x_wdata);
        end if;
        if x_wr = '1' and x_waddr = "010" then
          r_window <= x_wdata(15 downto 0);
        end if;
        complete <= r_complete and to_sl(r_lease /= 0);
        if hq.v = '1' and q_ct = "11" then
          n_none <= n_none + 1;
        end if;
        if hits_clear = '1' then
          n_none <= (others => '0');
        end if;
        -- indirect accesses: SHUNT_NONE reads and writes, CTM_CMD words (w3 runs the command)
        i_done <= '0';
        i_we <= '0';
        i_rd <= '0';
        i_rd2 <= i_rd;
        if i_rd2 = '1' then
          i_done <= '1';
          i_rdata <= sn_q(63 downto 32);
        end if;
        if c_hv = '1' and m_h_ready = '1' then  -- taken at this edge
          c_hv <= '0';
          c_pend <= '0';
          i_done <= '1';
          i_rdata <= (others => '0');
          if c_op = "11" then
            r_complete <= '0';  -- a clear empties the structure: not complete until the service says so
          end if;
        elsif c_pend = '1' and m_h_ready = '1' then
          c_hv <= '1';
        end if;
        if ind_req = '1' and ctm_tbl = '1' then
          idx := unsigned(ind_addr(23 downto 0));
          if unsigned(ind_addr(31 downto 24)) = TABLE_SHUNT_NONE then
            i_addr <= resize(idx, SNW);
            i_data <= ind_wdata;
            if idx >= SHUNT_WORDS then
              i_done <= '1';
              i_rdata <= (others => '0');
            elsif ind_write = '1' then
              i_we <= '1';
              i_done <= '1';
            else
              i_rd <= '1';
            end if;
          elsif ind_write = '0' then
            i_done <= '1';  -- CTM_CMD is write-only
            i_rdata <= (others => '0');
          elsif idx(1 downto 0) = "00" then  -- an if-chain: GHDL 2.0's Verilog drops a case's others branch
            c_w0 <= ind_wdata;
            i_done <= '1';
          elsif idx(1 downto 0) = "01" then
            c_w1 <= ind_wdata;
            i_done <= '1';
          elsif idx(1 downto 0) = "10" then
            c_w2 <= ind_wdata;
            i_done <= '1';
          else
            c_op <= ind_wdata(9 downto 8);
            c_v6 <= ind_wdata(10);
            c_proto <= ind_wdata(7 downto 0);
            c_pend <= '1';  -- done once the structure takes it
          end if;
        end if;
        if rst = '1' then
          r_complete <= '0';
          r_lease <= (others => '0');
          r_window <= REG_CTM_WINDOW_RESET(15 downto 0);
          complete <= '0';
          n_none <= (others => '0');
          c_pend <= '0';
          c_hv <= '0';
          i_done <= '0';
          i_we <= '0';
          i_rd <= '0';
          i_rd2 <= '0';
        end if;
      end if;
    end process;
    ctm_done <= i_done;
    ctm_rdata <= i_rdata;

    x_rdata <= std_logic_vector(n_none) & m_sat & m_members
               & (not (m_ready and not c_pend)) & (30 downto 16 => '0') & m_ref(15 downto 0)
               & (31 downto 25 => '0') & to_sl(V6_ON)
               & std_logic_vector(to_unsigned(CTM_LOG2 + 256 * 4 + 4096 * 4 + 65536 * CTM_EGRESS_LOG2, 24))
               & x"0000" & r_window & std_logic_vector(r_lease) & (31 downto 1 => '0') & r_complete;

    sweep : process (axis_aclk)
    begin
      if rising_edge(axis_aclk) then
        if sw_busy = '1' then
          sw_idx <= sw_idx + 1;
          if sw_idx = to_unsigned(2 ** SNW - 1, SNW) then
            sw_busy <= '0';
          end if;
        end if;
        sn_sel <= resize(lk_idx, 5);  -- the bit in its word (lk_idx may be narrower than 5 bits)
        if rst = '1' then
          sw_busy <= '1';
          sw_idx <= (others => '0');
        end if;
      end if;
    end process;
    sn_we <= sw_busy or i_we;
    sn_waddr <= sw_idx when sw_busy = '1' else i_addr;
    sn_wdata <= (others => '1') when sw_busy = '1' else i_data;
    shunt_none : entity work.hf_ram
      generic map (WIDTH => 32, ADDR_W => SNW, READS => 2)
      port map (clk => axis_aclk, we => sn_we, waddr => sn_waddr, wdata => sn_wdata,
                raddr => i_addr & resize(shift_right(lk_idx, 5), SNW), rdata => sn_q);
    sn_bit <= sn_q(to_integer(sn_sel)) or sw_busy;
  end generate;
end architecture;

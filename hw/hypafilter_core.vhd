-- hypafilter_core: the hardware firewall core (AXI4-Stream in/out, AXI4-Lite registers); the top level that
-- the SUME wrapper and the Verilator emulator instantiate. Frames go into a packet FIFO while a copy of their
-- header runs through parser, generated matcher, priority encoder and table lookup; the output stage joins
-- each frame with its decision (DROP, FORWARD to the paired MAC, SHUNT to the host with metadata; in host mode,
-- CONTROL bit 3, a hardware ACCEPT goes to the host too, with metadata reason 5 "decided").
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;
use work.hf_policy_pkg.all;

entity hypafilter_core is
  generic (
    C_S_AXIS_DATA_WIDTH  : positive := 256;    -- TDATA bits: 256 (SUME) or 512 (NetFPGA-PLUS)
    C_S_AXIS_TUSER_WIDTH : positive := 128;    -- TUSER bits (SUME layout, 128)
    C_S_AXI_ADDR_WIDTH   : positive := 12;     -- AXI4-Lite address bits (4 KB window)
    C_FIFO_DEPTH_BYTES   : positive := 65536   -- packet FIFO size; TDATA bytes times a power of two
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
    s_axi_rready  : in  std_logic
  );
end entity;

architecture rtl of hypafilter_core is
  constant DW : natural := C_S_AXIS_DATA_WIDTH;
  constant UW : natural := C_S_AXIS_TUSER_WIDTH;
  constant KW : natural := DW / 8;
  constant PKT_DEPTH : natural := C_FIFO_DEPTH_BYTES / KW;
  constant PW : natural := DW + KW + 1;      -- packet FIFO word: tdata, tkeep, tlast
  constant DECW : natural := 1 + EV_W + UW;  -- decision FIFO word: drop, events, tuser

  constant SIDE_DELAY : natural := MATCH_LATENCY + ENC_STAGES;

  type side_t is record
    v   : std_logic;
    unp : std_logic;
    unf : std_logic;  -- unfilterable by netfilter (two VLAN tags)
    tu  : std_logic_vector(UW - 1 downto 0);
  end record;
  type side_line is array (1 to SIDE_DELAY) of side_t;
  constant SIDE_ZERO : side_t := ('0', '0', '0', (others => '0'));
  signal side_in : side_t;
  signal side : side_line := (others => SIDE_ZERO);

  signal rst : std_logic;
  signal accept, pkt_in_ready : std_logic;
  signal h_valid, h_unp, h_unf : std_logic;
  signal h_tuser : std_logic_vector(UW - 1 downto 0);
  signal h_src, h_dst : std_logic_vector(31 downto 0);
  signal h_proto, h_it, h_ic, h_flags : std_logic_vector(7 downto 0);
  signal h_sport, h_dport : std_logic_vector(15 downto 0);
  signal h_iport : std_logic_vector(1 downto 0);
  -- what the flow cache knows of the frame (ir.box CT_*): no flow cache is wired yet, so every frame is unknown
  signal h_ct : std_logic_vector(1 downto 0) := "00";
  signal res : std_logic_vector(RES_WIDTH - 1 downto 0);
  signal enc_any : std_logic;
  signal enc_idx : unsigned(IDX_W - 1 downto 0);
  signal lk_idx : unsigned(IDX_W - 1 downto 0);
  signal lk_shunt : std_logic;
  signal tbl_ready : std_logic;  -- tables hold the policy (reset sweep done)
  signal lk_action : std_logic_vector(3 downto 0);

  signal t1 : side_t := SIDE_ZERO;
  signal t1_idx : unsigned(IDX_W - 1 downto 0) := (others => '0');
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
begin
  assert C_S_AXIS_DATA_WIDTH = 256 or C_S_AXIS_DATA_WIDTH = 512
    report "hypafilter_core: C_S_AXIS_DATA_WIDTH must be 256 or 512" severity failure;
  assert C_S_AXIS_TUSER_WIDTH = 128 report "hypafilter_core: C_S_AXIS_TUSER_WIDTH must be 128" severity failure;
  assert C_FIFO_DEPTH_BYTES mod KW = 0 and 2 ** clog2(PKT_DEPTH) = PKT_DEPTH and PKT_DEPTH >= 4
    report "hypafilter_core: C_FIFO_DEPTH_BYTES must be TDATA bytes times a power of two (>= 4 beats)"
    severity failure;
  assert N_ENTRIES < 2 ** 24 report "hypafilter_core: match_index must fit M[23:0]" severity failure;

  rst <= not axis_resetn;
  accept <= s_axis_tvalid and pkt_in_ready;
  s_axis_tready <= pkt_in_ready;

  pkt_fifo : entity work.hf_fifo
    generic map (WIDTH => PW, DEPTH => PKT_DEPTH)
    port map (
      clk => axis_aclk, rst => rst,
      in_data => s_axis_tlast & s_axis_tkeep & s_axis_tdata, in_valid => s_axis_tvalid, in_ready => pkt_in_ready,
      out_data => p_out, out_valid => p_valid, out_ready => p_ready);

  parser : entity work.hf_header_parser
    generic map (DATA_WIDTH => DW, TUSER_WIDTH => UW)
    port map (
      clk => axis_aclk, rst => rst, beat_valid => accept,
      tdata => s_axis_tdata, tkeep => s_axis_tkeep, tlast => s_axis_tlast, tuser => s_axis_tuser,
      h_valid => h_valid, h_unparsed => h_unp, h_unfilterable => h_unf, h_tuser => h_tuser,
      h_src => h_src, h_dst => h_dst, h_proto => h_proto, h_sport => h_sport, h_dport => h_dport,
      h_icmp_type => h_it, h_icmp_code => h_ic, h_iport => h_iport, h_flags => h_flags);

  matcher : entity work.hf_matcher
    port map (
      clk => axis_aclk, h_src => h_src, h_dst => h_dst, h_proto => h_proto, h_sport => h_sport,
      h_dport => h_dport, h_icmp_type => h_it, h_icmp_code => h_ic, h_iport => h_iport, h_ct => h_ct,
      h_flags => h_flags, res => res);

  encoder : entity work.hf_prio_enc
    generic map (N_IN => RES_WIDTH, FANIN => ENC_FANIN, STAGES => ENC_STAGES, IDX_W => IDX_W)
    port map (clk => axis_aclk, vec => res, any => enc_any, idx => enc_idx);

  -- frame information travelling beside matcher and encoder
  side_in <= (h_valid, h_unp, h_unf, h_tuser);
  side_shift : process (axis_aclk)
  begin
    if rising_edge(axis_aclk) then
      side(1) <= side_in;
      for i in 2 to SIDE_DELAY loop
        side(i) <= side(i - 1);
      end loop;
      if rst = '1' then
        for i in 1 to SIDE_DELAY loop
          side(i).v <= '0';
        end loop;
      end if;
    end if;
  end process;

  lk_idx <= enc_idx when enc_any = '1' else to_unsigned(N_ENTRIES, IDX_W);

  tables : entity work.hf_tables
    port map (
      clk => axis_aclk, rst => rst, lk_idx => lk_idx, lk_shunt => lk_shunt, lk_action => lk_action,
      hit_v => hit_v, hit_idx => hit_idx, hits_clear => hits_clear,
      ind_req => ind_req, ind_write => ind_write, ind_addr => ind_addr, ind_wdata => ind_wdata,
      ind_done => ind_done, ind_rdata => ind_rdata, ready => tbl_ready);

  decide : process (axis_aclk)
    variable sp : std_logic_vector(7 downto 0);
    variable wire, host, judge, classify, shunt, drop, deliver : boolean;
    variable ev : std_logic_vector(EV_W - 1 downto 0);
    variable tu : std_logic_vector(UW - 1 downto 0);
    variable dst : std_logic_vector(7 downto 0);
    variable reason, action : std_logic_vector(3 downto 0);
    variable idx : unsigned(23 downto 0);
  begin
    if rising_edge(axis_aclk) then
      t1 <= side(SIDE_DELAY);
      t1_idx <= lk_idx;

      sp := t1.tu(TUSER_SRC_LO + 7 downto TUSER_SRC_LO);
      wire := sp = x"01" or sp = x"04" or sp = x"10" or sp = x"40";
      host := sp = x"02" or sp = x"08" or sp = x"20" or sp = x"80";
      -- until the tables hold the policy nothing is judged here: wire frames go to netfilter as unparsed
      judge := wire and control(0) = '1' and tbl_ready = '1';
      classify := judge and t1.unp = '0';
      ev := (others => '0');
      shunt := false;
      drop := false;
      deliver := false;
      dst := (others => '0');
      idx := resize(t1_idx, 24);
      action := lk_action;
      reason := REASON_OVERRULE;
      if t1_idx = N_ENTRIES then
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
        action := x"0";
        reason := REASON_UNPARSED;
        ev(EV_UNPARSED) := '1';
      elsif lk_shunt = '1' or (action /= x"1" and action /= x"2") or control(1) = '1' then
        shunt := true;
        if reason = REASON_POLICY then
          ev(EV_POLICY) := '1';
        else
          ev(EV_OVERRULE) := '1';
        end if;
        if lk_shunt = '0' and (action = x"1" or action = x"2") then
          ev(EV_FORCED) := '1';
        end if;
      elsif (action = x"1" and control(4) = '1') or (action = x"2" and control(5) = '1') then
        -- miss forcing (MISS_SHUNT_ACCEPT/DROP): conntrack must see a frame of a connection the fast path does
        -- not know; h_ct is "00" for every frame until the flow cache is wired, so every frame is a miss
        shunt := true;
        reason := REASON_STATE;
      elsif action = x"1" and control(3) = '1' then
        -- host mode: the verdict is final; the frame goes to the ingress port's DMA queue, as a shunt does
        ev(EV_FORWARDED) := '1';
        deliver := true;
        reason := REASON_DECIDED;
      elsif action = x"1" then
        ev(EV_FORWARDED) := '1';
        case sp is
          when x"01" => dst := x"04";
          when x"04" => dst := x"01";
          when x"10" => dst := x"40";
          when others => dst := x"10";
        end case;
      else
        drop := true;
        ev(EV_DROPPED) := '1';
      end if;
      if wire then
        ev(EV_WIRE) := '1';
      end if;
      tu := t1.tu;
      if shunt or deliver then
        dst := sp(6 downto 0) & '0';
        tu(TUSER_META_LO + 63 downto TUSER_META_LO) := META_MAGIC & generation & reason & action & std_logic_vector(idx);
      end if;
      tu(TUSER_DST_LO + 7 downto TUSER_DST_LO) := dst;
      d_in_v <= t1.v;
      d_in <= to_sl(drop) & ev & tu;
      hit_v <= t1.v and to_sl(classify);
      hit_idx <= t1_idx;
      if rst = '1' then
        t1.v <= '0';
        d_in_v <= '0';
        hit_v <= '0';
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
      ind_wdata => ind_wdata, ind_done => ind_done, ind_rdata => ind_rdata);
end architecture;

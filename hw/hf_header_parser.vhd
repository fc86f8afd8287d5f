-- Header parser: captures the first header bytes of each frame off the stream and extracts the match fields.
-- Non-blocking: it only observes accepted beats and emits at most one header per cycle, 4 cycles after the
-- beat that completes the capture (the beat holding byte 95, or the last beat of a shorter frame).
-- The rules (what counts as unparsed) are the ones of hypafilter.hwmodel.parse_frame.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_header_parser is
  generic (
    DATA_WIDTH  : positive := 256;  -- TDATA bits: 256 (SUME) or 512 (NetFPGA-PLUS)
    TUSER_WIDTH : positive := 128   -- TUSER bits (SUME: 128)
  );
  port (
    clk        : in  std_logic;
    rst        : in  std_logic;
    beat_valid : in  std_logic;  -- tvalid and tready: a beat is accepted this cycle
    tdata      : in  std_logic_vector(DATA_WIDTH - 1 downto 0);
    tkeep      : in  std_logic_vector(DATA_WIDTH / 8 - 1 downto 0);
    tlast      : in  std_logic;
    tuser      : in  std_logic_vector(TUSER_WIDTH - 1 downto 0);
    h_valid    : out std_logic;  -- one pulse per frame
    h_unparsed : out std_logic;
    h_tuser    : out std_logic_vector(TUSER_WIDTH - 1 downto 0);  -- TUSER of the frame's first beat
    h_src      : out std_logic_vector(31 downto 0);
    h_dst      : out std_logic_vector(31 downto 0);
    h_proto    : out std_logic_vector(7 downto 0);
    h_sport    : out std_logic_vector(15 downto 0);
    h_dport    : out std_logic_vector(15 downto 0);
    h_icmp_type : out std_logic_vector(7 downto 0);
    h_icmp_code : out std_logic_vector(7 downto 0);
    h_iport    : out std_logic_vector(1 downto 0);
    h_flags    : out std_logic_vector(7 downto 0)
  );
end entity;

architecture rtl of hf_header_parser is
  constant BYTES : natural := DATA_WIDTH / 8;
  constant NHB   : natural := (HDR_NEED_BYTES + BYTES - 1) / BYTES;  -- beats captured
  constant HB    : natural := NHB * BYTES;                            -- bytes captured
  subtype buf_t is std_logic_vector(HB * 8 - 1 downto 0);

  function byte(b : buf_t; k : natural) return unsigned is
  begin
    return unsigned(b(8 * k + 7 downto 8 * k));
  end function;

  function u16(b : buf_t; k : natural) return unsigned is
  begin
    return byte(b, k) & byte(b, k + 1);
  end function;

  -- capture
  signal beat_cnt : natural range 0 to NHB := 0;
  signal hbuf      : buf_t := (others => '0');
  signal tuser_q  : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  signal have     : std_logic_vector(HB - 1 downto 0) := (others => '0');  -- byte k was received
  -- stage C: a complete capture
  signal c_v : std_logic := '0';
  signal c_buf : buf_t := (others => '0');
  signal c_have : std_logic_vector(HB - 1 downto 0) := (others => '0');
  signal c_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  -- stage 1: Ethernet and VLAN tags
  signal p1_v, p1_ip : std_logic := '0';
  signal p1_l3 : natural range 0 to 2 := 0;  -- tags before the IPv4 header
  signal p1_buf : buf_t := (others => '0');
  signal p1_have : std_logic_vector(HB - 1 downto 0) := (others => '0');
  signal p1_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  -- stage 2: IPv4 header
  signal p2_v, p2_ok : std_logic := '0';
  signal p2_buf : buf_t := (others => '0');
  signal p2_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  signal p2_l4sel : natural range 0 to 12 := 0;  -- L4 offset = 34 + 4 * p2_l4sel
  signal p2_l4room : unsigned(15 downto 0) := (others => '0');  -- IPv4 payload bytes (total length - IHL*4)
  signal p2_proto : std_logic_vector(7 downto 0) := (others => '0');
  signal p2_src, p2_dst : std_logic_vector(31 downto 0) := (others => '0');
  -- stage 3: output
  signal o_v, o_unp : std_logic := '0';
  signal o_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  signal o_src, o_dst : std_logic_vector(31 downto 0) := (others => '0');
  signal o_proto, o_it, o_ic, o_flags : std_logic_vector(7 downto 0) := (others => '0');
  signal o_sport, o_dport : std_logic_vector(15 downto 0) := (others => '0');
  signal o_iport : std_logic_vector(1 downto 0) := (others => '0');
begin
  assert DATA_WIDTH = 256 or DATA_WIDTH = 512
    report "hf_header_parser: DATA_WIDTH must be 256 or 512" severity failure;
  assert TUSER_WIDTH >= 128 report "hf_header_parser: TUSER_WIDTH must be at least 128" severity failure;

  capture : process (clk)
    variable nb : buf_t;
    variable nh : std_logic_vector(HB - 1 downto 0);
  begin
    if rising_edge(clk) then
      c_v <= '0';
      if beat_valid = '1' then
        if beat_cnt < NHB then
          nb := hbuf;
          -- Fixed slices selected by a loop: GHDL 2.0 synthesis drops the register behind a slice whose bounds
          -- depend on beat_cnt (simulation is right, the netlist is not), so never index a variable slice here.
          for k in 0 to NHB - 1 loop
            if beat_cnt = k then
              nb((k + 1) * DATA_WIDTH - 1 downto k * DATA_WIDTH) := tdata;
            end if;
          end loop;
          hbuf <= nb;
          -- which bytes exist: TKEEP is contiguous from byte 0, so a byte-valid mask replaces a byte count
          -- (a popcount here was 46 LUT levels deep)
          nh := have;
          if beat_cnt = 0 then
            nh := (others => '0');
          end if;
          for k in 0 to NHB - 1 loop
            if beat_cnt = k then
              nh((k + 1) * BYTES - 1 downto k * BYTES) := tkeep;
            end if;
          end loop;
          have <= nh;
          if beat_cnt = 0 then
            tuser_q <= tuser;
          end if;
          if tlast = '1' or beat_cnt = NHB - 1 then
            c_v <= '1';
            c_buf <= nb;
            c_have <= nh;
            if beat_cnt = 0 then
              c_tuser <= tuser;
            else
              c_tuser <= tuser_q;
            end if;
          end if;
        end if;
        if tlast = '1' then
          beat_cnt <= 0;
        elsif beat_cnt < NHB then
          beat_cnt <= beat_cnt + 1;
        end if;
      end if;
      if rst = '1' then
        beat_cnt <= 0;
        c_v <= '0';
      end if;
    end if;
  end process;

  ethernet : process (clk)
    variable et : unsigned(15 downto 0);
    variable tags : natural range 0 to 2;
  begin
    if rising_edge(clk) then
      et := u16(c_buf, 12);
      tags := 0;
      if et = x"8100" or et = x"88A8" then
        tags := 1;
        if u16(c_buf, 16) = x"8100" or u16(c_buf, 16) = x"88A8" then
          tags := 2;
          et := u16(c_buf, 20);
        else
          et := u16(c_buf, 16);
        end if;
      end if;
      p1_v <= c_v and not rst;
      p1_ip <= '1' when et = x"0800" else '0';
      p1_l3 <= tags;
      p1_buf <= c_buf;
      p1_have <= c_have;
      p1_tuser <= c_tuser;
    end if;
  end process;

  ipv4 : process (clk)
    variable ip : std_logic_vector(159 downto 0);  -- the 20 fixed IPv4 header bytes, byte 0 in bits 7..0
    variable ihl : unsigned(3 downto 0);
    variable total : unsigned(15 downto 0);
    variable l3 : natural range 14 to 22;
    variable present : std_logic;  -- the last fixed IPv4 header byte was received
    variable ok : boolean;
  begin
    if rising_edge(clk) then
      -- constant slices selected in a loop: a multiplexer, which GHDL synthesises without dynamic slicing
      ip := (others => '0');
      present := '0';
      for t in 0 to 2 loop
        if p1_l3 = t then
          ip := p1_buf(8 * (14 + 4 * t) + 159 downto 8 * (14 + 4 * t));
          present := p1_have(14 + 4 * t + 19);
        end if;
      end loop;
      l3 := 14 + 4 * p1_l3;
      ihl := unsigned(ip(3 downto 0));
      total := unsigned(ip(23 downto 16)) & unsigned(ip(31 downto 24));
      ok := p1_ip = '1'
            and present = '1'
            and ip(7 downto 4) = "0100"
            and ihl >= 5
            and total >= resize(ihl & "00", 16)
            and resize(total, 17) + l3 <= resize(unsigned(p1_tuser(TUSER_LEN_LO + 15 downto TUSER_LEN_LO)), 17)
            and ip(52 downto 48) & ip(63 downto 56) = "0000000000000";
      p2_v <= p1_v and not rst;
      p2_ok <= to_sl(ok);
      -- (l3 - 14) / 4 + (ihl - 5): the 13 possible L4 offsets 34, 38, ... 82
      if ihl >= 5 then
        p2_l4sel <= p1_l3 + to_integer(ihl) - 5;
      else
        p2_l4sel <= 0;
      end if;
      p2_l4room <= total - resize(ihl & "00", 16);
      p2_proto <= ip(79 downto 72);
      p2_src <= ip(103 downto 96) & ip(111 downto 104) & ip(119 downto 112) & ip(127 downto 120);
      p2_dst <= ip(135 downto 128) & ip(143 downto 136) & ip(151 downto 144) & ip(159 downto 152);
      p2_buf <= p1_buf;
      p2_tuser <= p1_tuser;
    end if;
  end process;

  transport_layer : process (clk)
    variable l4b : std_logic_vector(111 downto 0);  -- the first 14 L4 bytes
    variable need : natural range 0 to 20;
    variable is_tcp, is_udp, is_icmp : boolean;
    variable sp : std_logic_vector(7 downto 0);
  begin
    if rising_edge(clk) then
      l4b := (others => '0');
      for i in 0 to 12 loop
        if p2_l4sel = i then
          l4b := p2_buf(8 * (34 + 4 * i) + 111 downto 8 * (34 + 4 * i));
        end if;
      end loop;
      is_tcp := p2_proto = x"06";
      is_udp := p2_proto = x"11";
      is_icmp := p2_proto = x"01";
      -- the kernel's minimum L4 header sizes (xt_tcpudp, icmp match hotdrop anything shorter): a shorter header
      -- is netfilter's to judge, so it is shunted unparsed; only the first 14 bytes are read, the rest may lie
      -- beyond the capture and are checked against the IPv4 total length (itself checked against the frame)
      if is_tcp then
        need := 20;
      elsif is_udp then
        need := 8;
      elsif is_icmp then
        need := 8;
      else
        need := 0;
      end if;
      o_v <= p2_v and not rst;
      o_unp <= not (p2_ok and to_sl(p2_l4room >= need));
      o_tuser <= p2_tuser;
      o_src <= p2_src;
      o_dst <= p2_dst;
      o_proto <= p2_proto;
      o_sport <= (others => '0');
      o_dport <= (others => '0');
      o_it <= (others => '0');
      o_ic <= (others => '0');
      o_flags <= (others => '0');
      if is_tcp or is_udp then
        o_sport <= l4b(7 downto 0) & l4b(15 downto 8);
        o_dport <= l4b(23 downto 16) & l4b(31 downto 24);
      end if;
      if is_tcp then
        o_flags <= l4b(111 downto 104);
      end if;
      if is_icmp then
        o_it <= l4b(7 downto 0);
        o_ic <= l4b(15 downto 8);
      end if;
      sp := p2_tuser(TUSER_SRC_LO + 7 downto TUSER_SRC_LO);
      case sp is
        when x"04" => o_iport <= "01";
        when x"10" => o_iport <= "10";
        when x"40" => o_iport <= "11";
        when others => o_iport <= "00";
      end case;
    end if;
  end process;

  h_valid <= o_v;
  h_unparsed <= o_unp;
  h_tuser <= o_tuser;
  h_src <= o_src;
  h_dst <= o_dst;
  h_proto <= o_proto;
  h_sport <= o_sport;
  h_dport <= o_dport;
  h_icmp_type <= o_it;
  h_icmp_code <= o_ic;
  h_iport <= o_iport;
  h_flags <= o_flags;
end architecture;

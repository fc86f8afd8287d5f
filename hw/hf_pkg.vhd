-- Shared constants and helpers of the static hypafilter core (TUSER positions, metadata layout, small functions).
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

package hf_pkg is
  -- TUSER fields (first beat), SUME conventions
  constant TUSER_LEN_LO  : natural := 0;
  constant TUSER_SRC_LO  : natural := 16;
  constant TUSER_DST_LO  : natural := 24;
  constant TUSER_META_LO : natural := 64;

  -- metadata M (ARCHITECTURE.md section 4; driver/hypafilter_shared.h)
  constant META_MAGIC : std_logic_vector(15 downto 0) := x"4846";
  constant REASON_OVERRULE : std_logic_vector(3 downto 0) := x"0";
  constant REASON_POLICY   : std_logic_vector(3 downto 0) := x"1";
  constant REASON_UNPARSED : std_logic_vector(3 downto 0) := x"2";
  constant REASON_STATE    : std_logic_vector(3 downto 0) := x"3";  -- ct unknown, forced by CONTROL bit 4/5
  constant REASON_MIRROR   : std_logic_vector(3 downto 0) := x"4";  -- a copy for the host's observing rules
  constant REASON_DECIDED  : std_logic_vector(3 downto 0) := x"5";  -- host mode: the hardware's ACCEPT is final

  -- every byte the parser reads is below this offset: 14 + 1 tag + 60 (IHL 15) + 14 TCP bytes
  constant HDR_NEED_BYTES : natural := 92;

  -- counter event bits carried with each decision and counted when the frame leaves
  constant EV_FORWARDED : natural := 0;
  constant EV_DROPPED   : natural := 1;
  constant EV_OVERRULE  : natural := 2;
  constant EV_POLICY    : natural := 3;
  constant EV_UNPARSED  : natural := 4;
  constant EV_FROM_HOST : natural := 5;
  constant EV_FORCED    : natural := 6;
  constant EV_WIRE      : natural := 7;
  constant EV_UNFILTERABLE : natural := 8;  -- dropped: netfilter cannot filter it (CONTROL bit 2 clear)
  constant EV_STATE  : natural := 9;  -- shunted with reason 3: a flow-cache miss (CONTROL bits 4/5)
  constant EV_MIRROR : natural := 10;  -- the host gets the frame or a copy with reason 4 (ACTION bit 3)
  constant EV_SET_UNC : natural := 11;  -- shunted with reason 3: a set lookup was uncertain (issue #24)
  constant EV_W      : natural := 12;

  function clog2(n : natural) return natural;
  function popcount(v : std_logic_vector) return natural;
  function to_sl(b : boolean) return std_logic;
  -- the flow cache's canonical key width (hf_flow_cache): 104 bits for IPv4 tuples; with IPv6 tuples (V6) 304 bits,
  -- a family byte, two 128-bit addresses, two ports and the protocol (hypafilter.hw.flowcache.key_bits)
  function fc_key_w(v6 : boolean) return natural;
end package;

package body hf_pkg is
  function clog2(n : natural) return natural is
    variable r : natural := 0;
  begin
    while 2 ** r < n loop
      r := r + 1;
    end loop;
    return r;
  end function;

  function popcount(v : std_logic_vector) return natural is
    variable c : natural := 0;
  begin
    for i in v'range loop
      if v(i) = '1' then
        c := c + 1;
      end if;
    end loop;
    return c;
  end function;
  function fc_key_w(v6 : boolean) return natural is
  begin
    if v6 then
      return 304;
    end if;
    return 104;
  end function;

  function to_sl(b : boolean) return std_logic is
  begin
    if b then
      return '1';
    end if;
    return '0';
  end function;
end package body;

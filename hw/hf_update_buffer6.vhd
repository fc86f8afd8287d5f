-- The SFL update buffer for IPv6 frames (docs/ipv6.md "## emu", "Not done": its design; ARCHITECTURE.md section 8;
-- the decision of hypafilter.analysis.overlay.hw_indices over analysis.overlay.align6's overlay): hf_update_buffer's
-- scheme with the addresses as raw 128-bit closed intervals, so that a slot needs no rank of the running IPv6
-- matcher (the core's IPv6 match units compare addresses too). A valid mask over the N_STATIC static IPv6 entries
-- and DEPTH slots; st_idx is the static IPv6 index, local (0 .. N_STATIC - 1, N_STATIC: no valid entry matched),
-- and `idx` is N_STATIC + 1 + b for the first enabled slot b, in slot order, that holds the header and has
-- pos_b <= st_idx, else st_idx (the core adds V6_BASE).
--
-- Table BUF6 (T_BUF), 32 words per slot: w0..w3 src lo, w4..w7 src hi, w8..w11 dst lo, w12..w15 dst hi (each four
-- 32-bit chunks, most significant first), w16..w22 as BUF's w4..w10 (sport, dport, proto | icmp_type, icmp_code |
-- iport | ct, flags, control: enable << 31 | pos, sets); w23..w31 read 0. Table VALID6 (any other table id the core
-- routes here): the valid mask, 32 entries a word. A 128-bit bound is compared as four 32-bit chunks in the first
-- stage (each chunk's > or < and =, the lowest chunk's >= or <=; no comparator wider than 32 bits: GHDL writes a
-- wider constant into Verilog as a string) and combined lexicographically in the second, so the slot match takes
-- the two cycles of hf_update_buffer's. The register access, the read-back copies, the valid mask and the slot
-- encoder are hf_update_buffer_shell's, as there. A slot's words are one array written by one process:
-- hf_update_buffer's form (each word a register of its own, in blocks per 32-bit chunk) made the emulator's model
-- slower, 0.09 against 0.12 M cycles per CPU second at 16 slots (docs/ipv6.md "What it costs the emulator").
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_update_buffer6 is
  generic (
    N_STATIC : natural := 8;   -- static IPv6 entries: bits of the valid mask
    DEPTH    : natural := 16;  -- buffer slots (0: the valid mask alone; idx is then st_idx)
    IDX_W    : positive := 6;  -- bits of a local index, 0 .. N_STATIC + DEPTH
    I_DELAY  : positive := 3;  -- cycles from a header on h_* to its static index on st_idx (>= 2)
    FANIN    : positive := 8;  -- fan-in of the slot encoder (a power of two >= 2)
    STAGES   : positive := 1;  -- its stages, the least s with FANIN ** s >= DEPTH
    T_BUF    : natural := 12   -- the table id of BUF6 in IND_ADDRESS (any other id: VALID6)
  );
  port (
    clk         : in  std_logic;
    rst         : in  std_logic;  -- synchronous: every static entry valid, every slot disabled
    h_src       : in  std_logic_vector(127 downto 0);
    h_dst       : in  std_logic_vector(127 downto 0);
    h_proto     : in  std_logic_vector(7 downto 0);
    h_sport     : in  std_logic_vector(15 downto 0);
    h_dport     : in  std_logic_vector(15 downto 0);
    h_icmp_type : in  std_logic_vector(7 downto 0);
    h_icmp_code : in  std_logic_vector(7 downto 0);
    h_iport     : in  std_logic_vector(1 downto 0);
    h_ct        : in  std_logic_vector(1 downto 0);
    h_flags     : in  std_logic_vector(7 downto 0);
    h_sets      : in  std_logic_vector(7 downto 0) := (others => '0');
    h_on        : in  std_logic := '1';  -- '0': no slot may match the header (not a parsed IPv6 frame)
    valid       : out std_logic_vector(maximum(N_STATIC, 1) - 1 downto 0);
    st_idx      : in  unsigned(IDX_W - 1 downto 0);
    idx         : out unsigned(IDX_W - 1 downto 0);  -- 0 cycles after st_idx without slots, else 1 + STAGES
    ind_req     : in  std_logic;
    ind_write   : in  std_logic;
    ind_addr    : in  std_logic_vector(31 downto 0);
    ind_wdata   : in  std_logic_vector(31 downto 0);
    ind_done    : out std_logic;
    ind_rdata   : out std_logic_vector(31 downto 0)
  );
end entity;

architecture rtl of hf_update_buffer6 is
  constant SD : positive := maximum(DEPTH, 1);
  constant USED : natural := 23;
  constant W_O : natural := 16;  -- the first word after the addresses (BUF's w4)
  constant W_FLAGS : natural := 20;
  constant W_CONTROL : natural := 21;
  constant W_SETS : natural := 22;

  function mask_of(w : unsigned(4 downto 0)) return std_logic_vector is
    variable m : std_logic_vector(31 downto 0) := (others => '0');
  begin
    if w < 19 then
      m := (others => '1');
    elsif w = 19 then
      m := x"00FFFFFF";
    elsif w = W_FLAGS or w = W_SETS then
      m := x"0000FFFF";
    elsif w = W_CONTROL then
      m(31) := '1';
      m(minimum(IDX_W, 24) - 1 downto 0) := (others => '1');
    end if;
    return m;
  end function;

  function chunk(x : std_logic_vector(127 downto 0); k : natural) return unsigned is
  begin
    return unsigned(x(127 - 32 * k downto 96 - 32 * k));
  end function;

  type word_arr is array (0 to USED - 1) of std_logic_vector(31 downto 0);
  signal win : std_logic_vector(SD - 1 downto 0) := (others => '0');
  -- a host write to BUF6 (hf_update_buffer_shell): word w_index(4 downto 0) of slot w_index(23 downto 5)
  signal w_en : std_logic;
  signal w_index : unsigned(23 downto 0);
  signal w_data, w_mask : std_logic_vector(31 downto 0);

  function in_range(x, lo, hi : std_logic_vector) return std_logic is
  begin
    return (unsigned(x) ?>= unsigned(lo)) and (unsigned(x) ?<= unsigned(hi));
  end function;
begin
  assert I_DELAY >= 2 report "hf_update_buffer6: I_DELAY must be at least 2" severity failure;
  assert 2 ** IDX_W > N_STATIC + DEPTH report "hf_update_buffer6: IDX_W too small" severity failure;

  w_mask <= mask_of(w_index(4 downto 0));
  shell : entity work.hf_update_buffer_shell
    generic map (N_STATIC => N_STATIC, DEPTH => DEPTH, IDX_W => IDX_W, FANIN => FANIN, STAGES => STAGES,
                 WORD_BITS => 5, USED => USED, T_BUF => T_BUF)
    port map (clk => clk, rst => rst, valid => valid, st_idx => st_idx, win => win, idx => idx, w_en => w_en,
              w_index => w_index, w_data => w_data, w_mask => w_mask, ind_req => ind_req,
              ind_write => ind_write, ind_addr => ind_addr, ind_wdata => ind_wdata, ind_done => ind_done,
              ind_rdata => ind_rdata);

  slots : if DEPTH > 0 generate
    slot : for b in 0 to DEPTH - 1 generate
      signal w : word_arr := (others => (others => '0'));
      -- stage 1, per address (0 src, 1 dst) and chunk k: above lo (gt, the lowest chunk >=), equal to lo, below hi
      -- (lt, the lowest chunk <=), equal to hi
      signal gt, eql, lt, eqh : std_logic_vector(7 downto 0) := (others => '0');
      signal c : std_logic_vector(8 downto 0) := (others => '0');
      signal m : std_logic_vector(2 to maximum(I_DELAY, 2)) := (others => '0');
      signal on1 : std_logic := '0';
    begin
      slot_words : process (clk)
      begin
        if rising_edge(clk) then
          if w_en = '1' and w_index(23 downto 5) = b then
            for k in 0 to USED - 1 loop
              if w_index(4 downto 0) = k then
                w(k) <= w_data and mask_of(to_unsigned(k, 5));
              end if;
            end loop;
          end if;
          if rst = '1' then
            w(W_CONTROL) <= (others => '0');
          end if;
        end if;
      end process;

      test : process (clk)
        variable x, lo, hi : unsigned(31 downto 0);
        variable ge, le : std_logic;
      begin
        if rising_edge(clk) then
          -- stage 1: each 32-bit chunk of each address against its bounds, and the other fields as BUF's
          for a in 0 to 1 loop
            for k in 0 to 3 loop
              if a = 0 then
                x := chunk(h_src, k);
              else
                x := chunk(h_dst, k);
              end if;
              lo := unsigned(w(8 * a + k));
              hi := unsigned(w(8 * a + 4 + k));
              if k = 3 then
                gt(4 * a + k) <= x ?>= lo;
                lt(4 * a + k) <= x ?<= hi;
              else
                gt(4 * a + k) <= x ?> lo;
                lt(4 * a + k) <= x ?< hi;
              end if;
              eql(4 * a + k) <= x ?= lo;
              eqh(4 * a + k) <= x ?= hi;
            end loop;
          end loop;
          c(0) <= in_range(h_proto, w(W_O + 2)(7 downto 0), w(W_O + 2)(15 downto 8));
          c(1) <= in_range(h_sport, w(W_O)(15 downto 0), w(W_O)(31 downto 16));
          c(2) <= in_range(h_dport, w(W_O + 1)(15 downto 0), w(W_O + 1)(31 downto 16));
          c(3) <= in_range(h_icmp_type, w(W_O + 2)(23 downto 16), w(W_O + 2)(31 downto 24));
          c(4) <= in_range(h_icmp_code, w(W_O + 3)(7 downto 0), w(W_O + 3)(15 downto 8));
          c(5) <= in_range(h_iport, w(W_O + 3)(17 downto 16), w(W_O + 3)(19 downto 18));
          c(6) <= in_range(h_ct, w(W_O + 3)(21 downto 20), w(W_O + 3)(23 downto 22));
          c(7) <= to_sl((h_flags and w(W_FLAGS)(7 downto 0)) = w(W_FLAGS)(15 downto 8));
          c(8) <= to_sl((h_sets and w(W_SETS)(7 downto 0)) = w(W_SETS)(15 downto 8));
          on1 <= h_on;
          -- stage 2: each address within its bounds (lexicographic over the chunks), every field: the slot's box
          ge := '1';
          le := '1';
          for a in 0 to 1 loop
            ge := ge and (gt(4 * a) or (eql(4 * a) and (gt(4 * a + 1) or (eql(4 * a + 1) and (gt(4 * a + 2) or
                  (eql(4 * a + 2) and gt(4 * a + 3)))))));
            le := le and (lt(4 * a) or (eqh(4 * a) and (lt(4 * a + 1) or (eqh(4 * a + 1) and (lt(4 * a + 2) or
                  (eqh(4 * a + 2) and lt(4 * a + 3)))))));
          end loop;
          m(2) <= to_sl(c = (c'range => '1')) and ge and le and on1;
          for k in 3 to I_DELAY loop
            m(k) <= m(k - 1);
          end loop;
          win(b) <= m(I_DELAY) and w(W_CONTROL)(31) and to_sl(unsigned(w(W_CONTROL)(IDX_W - 1 downto 0)) <= st_idx);
        end if;
      end process;
    end generate;
  end generate;
end architecture;

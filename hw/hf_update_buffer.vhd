-- The SFL update buffer beside the static matcher (ARCHITECTURE.md section 8; hypafilter.analysis.overlay.hw_indices
-- is the decision it implements): a run-time valid mask over the static entries and DEPTH run-time-writable slots
-- (per-field closed ranges, a TCP-flags ternary, an insert position and an enable bit), one header per cycle.
-- The matcher ANDs its entries with `valid`; the static encoder's index i (N_STATIC when no valid entry matched)
-- comes back on st_idx, and `idx` is N_STATIC + 1 + b for the first enabled slot b, in slot order, that matches the
-- header and has pos_b <= i, else i. Register image and word layout: hypafilter.hw.updatebuffer (tables VALID, BUF).
-- The slots' words live in registers (every slot is compared every cycle); the host reads them back from a copy in
-- block RAM written alongside, as it does the valid mask: a read multiplexer over the registers cost more than the
-- slots' comparators (4,200 of 7,600 LUTs at 16 slots, yosys). The copies are swept to their reset values after
-- power-on and every reset, as hf_tables does; the registers are reset at once, so the fast path never waits.
-- Each slot and each VALID word is a generate block with registers of its own: one process writing an array of
-- them became, in GHDL's Verilog, one 5,120-bit vector rebuilt by wide inserts every cycle (10x slower emulator).
-- The register access, the copies, the valid mask and the slot encoder are hf_update_buffer_shell's (shared with
-- hf_update_buffer6); the slots are this entity's.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;
use work.hf_regs_pkg.all;

entity hf_update_buffer is
  generic (
    N_STATIC : natural := 8;   -- static entries of the matcher: bits of the valid mask
    DEPTH    : natural := 16;  -- buffer slots (0: the valid mask alone; idx is then st_idx)
    IDX_W    : positive := 6;  -- bits of a hardware index, 0 .. N_STATIC + DEPTH
    I_DELAY  : positive := 3;  -- cycles from a header on h_* to its static index on st_idx (>= 2)
    FANIN    : positive := 8;  -- fan-in of the slot encoder (a power of two >= 2)
    STAGES   : positive := 1   -- its stages, the least s with FANIN ** s >= DEPTH (hypafilter.hw.vhdl.buffer_stages)
  );
  port (
    clk         : in  std_logic;
    rst         : in  std_logic;  -- synchronous: every static entry valid, every slot disabled and zero
    h_src       : in  std_logic_vector(31 downto 0);
    h_dst       : in  std_logic_vector(31 downto 0);
    h_proto     : in  std_logic_vector(7 downto 0);
    h_sport     : in  std_logic_vector(15 downto 0);
    h_dport     : in  std_logic_vector(15 downto 0);
    h_icmp_type : in  std_logic_vector(7 downto 0);
    h_icmp_code : in  std_logic_vector(7 downto 0);
    h_iport     : in  std_logic_vector(1 downto 0);
    h_ct        : in  std_logic_vector(1 downto 0);
    h_flags     : in  std_logic_vector(7 downto 0);
    h_sets      : in  std_logic_vector(7 downto 0) := (others => '0');  -- set slot bits (hf_set_table), 0 padded
    h_on        : in  std_logic := '1';  -- '0': no slot may match the header (an IPv6 frame: the slots are IPv4's)
    valid       : out std_logic_vector(maximum(N_STATIC, 1) - 1 downto 0);  -- the valid mask, to the matcher
    st_idx      : in  unsigned(IDX_W - 1 downto 0);  -- the static index, I_DELAY cycles after the header
    -- the hardware index, LATENCY cycles after st_idx: 0 without slots (combinational), else 1 + STAGES
    idx         : out unsigned(IDX_W - 1 downto 0);
    -- indirect access to the tables VALID and BUF (IND_ADDRESS = table << 24 | index); one request at a time,
    -- answered (ind_done) 3 cycles after it, later while the read-back memories are swept after a reset
    ind_req     : in  std_logic;
    ind_write   : in  std_logic;
    ind_addr    : in  std_logic_vector(31 downto 0);
    ind_wdata   : in  std_logic_vector(31 downto 0);
    ind_done    : out std_logic;
    ind_rdata   : out std_logic_vector(31 downto 0)
  );
end entity;

architecture rtl of hf_update_buffer is
  constant SD : positive := maximum(DEPTH, 1);
  constant WORDS : natural := 16;  -- BUF index stride per slot (hypafilter.hw.updatebuffer.WORDS)
  constant USED : natural := 11;   -- words 0..10 hold a slot, 11..15 read 0
  constant W_FLAGS : natural := 8;
  constant W_CONTROL : natural := 9;
  constant W_SETS : natural := 10;  -- set slot bits mask | value << 8 (issue #24)
  constant NF : natural := 10;     -- fields (ir.FIELDS), the flags test, then the sets test: NF + 1 compare bits

  -- the bits each word holds (hypafilter.hw.updatebuffer.WORD_MASKS); the control word keeps IDX_W bits of pos
  type mask_arr is array (0 to USED - 1) of std_logic_vector(31 downto 0);
  function word_masks return mask_arr is
    variable m : mask_arr := (others => (others => '1'));
  begin
    m(6) := x"FFFFFFFF";
    m(7) := x"00FFFFFF";
    m(W_FLAGS) := x"0000FFFF";
    m(W_SETS) := x"0000FFFF";
    m(W_CONTROL) := (others => '0');
    m(W_CONTROL)(31) := '1';
    m(W_CONTROL)(minimum(IDX_W, 24) - 1 downto 0) := (others => '1');
    return m;
  end function;
  constant WMASK : mask_arr := word_masks;

  -- WMASK of a word number that is a signal: an if-chain, not an index into WMASK, which GHDL 2.0's VHDL netlist
  -- made a ROM with its words in reverse order, indexed without the bound (docs/hardware.md, GHDL traps)
  function mask_of(w : unsigned(3 downto 0)) return std_logic_vector is
    variable m : std_logic_vector(31 downto 0) := (others => '0');
  begin
    for k in 0 to USED - 1 loop
      if w = k then
        m := WMASK(k);
      end if;
    end loop;
    return m;
  end function;

  signal win : std_logic_vector(SD - 1 downto 0) := (others => '0');
  -- a host write to BUF (hf_update_buffer_shell): word w_index(3 downto 0) of slot w_index(23 downto 4)
  signal w_en : std_logic;
  signal w_index : unsigned(23 downto 0);
  signal w_data, w_mask : std_logic_vector(31 downto 0);

  -- lo <= x <= hi with the matching relational operators: std_logic results, no short-circuit `and` of booleans
  -- (GHDL writes that as multiplexers, which the emulator evaluates every cycle for every slot)
  function in_range(x, lo, hi : std_logic_vector) return std_logic is
  begin
    return (unsigned(x) ?>= unsigned(lo)) and (unsigned(x) ?<= unsigned(hi));
  end function;
begin
  assert I_DELAY >= 2 report "hf_update_buffer: I_DELAY must be at least 2 (the slot match takes 2 cycles)"
    severity failure;
  assert 2 ** IDX_W > N_STATIC + DEPTH report "hf_update_buffer: IDX_W too small" severity failure;
  assert DEPTH * WORDS <= 2 ** 24 and IDX_W <= 24 report "hf_update_buffer: too large for the BUF table and its pos field"
    severity failure;

  -- the register access, the read-back copies, the valid mask and the slot encoder
  w_mask <= mask_of(w_index(3 downto 0));
  shell : entity work.hf_update_buffer_shell
    generic map (N_STATIC => N_STATIC, DEPTH => DEPTH, IDX_W => IDX_W, FANIN => FANIN, STAGES => STAGES,
                 WORD_BITS => 4, USED => USED, T_BUF => TABLE_BUF)
    port map (clk => clk, rst => rst, valid => valid, st_idx => st_idx, win => win, idx => idx, w_en => w_en,
              w_index => w_index, w_data => w_data, w_mask => w_mask, ind_req => ind_req,
              ind_write => ind_write, ind_addr => ind_addr, ind_wdata => ind_wdata, ind_done => ind_done,
              ind_rdata => ind_rdata);

  slots : if DEPTH > 0 generate
    -- one block per slot: its eleven words (written by the host), the two stages that test a header
    -- against them (words 0..8 read in the header's cycle), its match bit waiting for the static index, and its
    -- win bit (the control word read in the static index's cycle)
    slot : for b in 0 to DEPTH - 1 generate
      signal w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10 : std_logic_vector(31 downto 0) := (others => '0');
      signal c : std_logic_vector(NF downto 0) := (others => '0');
      signal m : std_logic_vector(2 to maximum(I_DELAY, 2)) := (others => '0');
      signal on1 : std_logic := '0';  -- h_on, registered beside the stage-1 tests
    begin
      words : process (clk)
      begin
        if rising_edge(clk) then
          if w_en = '1' and w_index(23 downto 4) = b then
            if w_index(3 downto 0) = 0 then w0 <= w_data; end if;
            if w_index(3 downto 0) = 1 then w1 <= w_data; end if;
            if w_index(3 downto 0) = 2 then w2 <= w_data; end if;
            if w_index(3 downto 0) = 3 then w3 <= w_data; end if;
            if w_index(3 downto 0) = 4 then w4 <= w_data; end if;
            if w_index(3 downto 0) = 5 then w5 <= w_data; end if;
            if w_index(3 downto 0) = 6 then w6 <= w_data and WMASK(6); end if;
            if w_index(3 downto 0) = 7 then w7 <= w_data and WMASK(7); end if;
            if w_index(3 downto 0) = W_FLAGS then w8 <= w_data and WMASK(W_FLAGS); end if;
            if w_index(3 downto 0) = W_CONTROL then w9 <= w_data and WMASK(W_CONTROL); end if;
            if w_index(3 downto 0) = W_SETS then w10 <= w_data and WMASK(W_SETS); end if;
          end if;
          -- a reset disables the slot; its other words matter only once the host enables it again, after writing
          -- all eleven (hw.updatebuffer.writes; the host reads them back from the copy, which the sweep zeroes)
          if rst = '1' then
            w9 <= (others => '0');
          end if;
        end if;
      end process;

      test : process (clk)
      begin
        if rising_edge(clk) then
          -- stage 1: each field against its range, and the flags test
          c(0) <= in_range(h_src, w0, w1);
          c(1) <= in_range(h_dst, w2, w3);
          c(2) <= in_range(h_proto, w6(7 downto 0), w6(15 downto 8));
          c(3) <= in_range(h_sport, w4(15 downto 0), w4(31 downto 16));
          c(4) <= in_range(h_dport, w5(15 downto 0), w5(31 downto 16));
          c(5) <= in_range(h_icmp_type, w6(23 downto 16), w6(31 downto 24));
          c(6) <= in_range(h_icmp_code, w7(7 downto 0), w7(15 downto 8));
          c(7) <= in_range(h_iport, w7(17 downto 16), w7(19 downto 18));
          c(8) <= in_range(h_ct, w7(21 downto 20), w7(23 downto 22));
          c(9) <= to_sl((h_flags and w8(7 downto 0)) = w8(15 downto 8));
          c(10) <= to_sl((h_sets and w10(7 downto 0)) = w10(15 downto 8));
          on1 <= h_on;
          -- stage 2: the slot's box holds the header; then the bit waits for the static index
          m(2) <= to_sl(c = (c'range => '1')) and on1;
          for k in 3 to I_DELAY loop
            m(k) <= m(k - 1);
          end loop;
          -- the slot may win: enabled, and placed no later than the static match
          win(b) <= m(I_DELAY) and w9(31) and to_sl(unsigned(w9(IDX_W - 1 downto 0)) <= st_idx);
        end if;
      end process;
    end generate;
  end generate;
end architecture;

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
  constant VW : positive := maximum(N_STATIC, 1);
  constant VWORDS : natural := (N_STATIC + 31) / 32;
  constant SD : positive := maximum(DEPTH, 1);
  constant WORDS : natural := 16;  -- BUF index stride per slot (hypafilter.hw.updatebuffer.WORDS)
  constant USED : natural := 11;   -- words 0..10 hold a slot, 11..15 read 0
  constant W_FLAGS : natural := 8;
  constant W_CONTROL : natural := 9;
  constant W_SETS : natural := 10;  -- set slot bits mask | value << 8 (issue #24)
  constant NF : natural := 10;     -- fields (ir.FIELDS), the flags test, then the sets test: NF + 1 compare bits
  constant EW : positive := maximum(clog2(SD), 1);
  constant BA : positive := maximum(clog2(SD * WORDS), 1);  -- address bits of the BUF copy
  constant VA : positive := maximum(clog2(maximum(VWORDS, 1)), 1);  -- and of the VALID copy
  constant SWEEP : positive := maximum(2 ** BA, 2 ** VA);  -- cycles of the sweep that resets both copies

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

  -- the bits of VALID word k that are static entries (all but the last word: all of them)
  function valid_mask(k : natural) return std_logic_vector is
    variable m : std_logic_vector(31 downto 0) := (others => '0');
  begin
    for j in 0 to 31 loop
      if 32 * k + j < N_STATIC then
        m(j) := '1';
      end if;
    end loop;
    return m;
  end function;
  constant LAST_MASK : std_logic_vector(31 downto 0) := valid_mask(maximum(VWORDS, 1) - 1);

  signal vm : std_logic_vector(VW - 1 downto 0);
  signal win : std_logic_vector(SD - 1 downto 0);
  signal e_any : std_logic;
  signal e_idx : unsigned(EW - 1 downto 0);
  type idx_line is array (1 to STAGES + 1) of unsigned(IDX_W - 1 downto 0);
  signal sil : idx_line := (others => (others => '0'));

  -- host side: a request is taken (r_v) unless the sweep runs (then it waits: pend), writes land at the end of the
  -- r_v cycle, the copies answer a cycle later (r2_v), ind_done the cycle after
  signal swp : std_logic := '1';
  signal sw_idx : unsigned(clog2(SWEEP) downto 0) := (others => '0');
  signal pend, r_v, r2_v, r2_ok, r_buf, r_write, done : std_logic := '0';
  signal r_index : unsigned(23 downto 0) := (others => '0');
  signal r_data, rdata : std_logic_vector(31 downto 0) := (others => '0');
  signal in_buf, in_valid : std_logic;
  signal b_we, v_we : std_logic;
  signal b_wa, b_ra : unsigned(BA - 1 downto 0);
  signal v_wa, v_ra : unsigned(VA - 1 downto 0);
  signal b_wd, v_wd, b_q, v_q : std_logic_vector(31 downto 0);

  -- lo <= x <= hi with the matching relational operators: std_logic results, no short-circuit `and` of booleans
  -- (GHDL writes that as multiplexers, which the emulator evaluates every cycle for every slot)
  function in_range(x, lo, hi : std_logic_vector) return std_logic is
  begin
    return (unsigned(x) ?>= unsigned(lo)) and (unsigned(x) ?<= unsigned(hi));
  end function;
begin
  assert I_DELAY >= 2 report "hf_update_buffer: I_DELAY must be at least 2 (the slot match takes 2 cycles)"
    severity failure;
  assert DEPTH = 0 or (FANIN ** STAGES >= DEPTH and (STAGES = 1 or FANIN ** (STAGES - 1) < DEPTH))
    report "hf_update_buffer: STAGES is not the least s with FANIN ** s >= DEPTH" severity failure;
  assert 2 ** IDX_W > N_STATIC + DEPTH report "hf_update_buffer: IDX_W too small" severity failure;
  assert DEPTH * WORDS <= 2 ** 24 and IDX_W <= 24 report "hf_update_buffer: too large for the BUF table and its pos field"
    severity failure;

  valid <= vm;

  in_buf <= to_sl(r_buf = '1' and r_index(3 downto 0) < USED and r_index(23 downto 4) < DEPTH);
  in_valid <= to_sl(r_buf = '0' and r_index < VWORDS);

  host : process (clk)
  begin
    if rising_edge(clk) then
      done <= '0';
      r_v <= '0';
      r2_v <= r_v;
      r2_ok <= r_v and not r_write and (in_buf or in_valid);
      if ind_req = '1' then
        r_v <= not swp;
        pend <= swp;
        r_buf <= to_sl(unsigned(ind_addr(31 downto 24)) = TABLE_BUF);
        r_write <= ind_write;
        r_index <= unsigned(ind_addr(23 downto 0));
        r_data <= ind_wdata;
      elsif pend = '1' and swp = '0' then
        pend <= '0';
        r_v <= '1';
      end if;
      if r2_v = '1' then
        done <= '1';
        rdata <= (others => '0');
        if r2_ok = '1' then
          rdata <= b_q when r_buf = '1' else v_q;
        end if;
      end if;
      -- the sweep of the copies: power-on (swp starts at '1') and every reset
      if swp = '1' then
        sw_idx <= sw_idx + 1;
        if sw_idx = SWEEP - 1 then
          swp <= '0';
        end if;
      end if;
      if rst = '1' then
        done <= '0';
        r_v <= '0';
        r2_v <= '0';
        pend <= '0';
        swp <= '1';
        sw_idx <= (others => '0');
      end if;
    end if;
  end process;
  ind_done <= done;
  ind_rdata <= rdata;

  -- the copies the host reads: written with the registers (masked the same way), or by the sweep
  b_we <= (swp and to_sl(sw_idx < 2 ** BA)) or (r_v and r_write and in_buf);
  b_wa <= resize(sw_idx, BA) when swp = '1' else resize(r_index, BA);
  b_wd <= (others => '0') when swp = '1' else r_data and mask_of(r_index(3 downto 0));
  b_ra <= resize(r_index, BA);
  v_we <= (swp and to_sl(sw_idx < 2 ** VA)) or (r_v and r_write and in_valid);
  v_wa <= resize(sw_idx, VA) when swp = '1' else resize(r_index, VA);
  v_wd <= (others => '1') when swp = '1' and sw_idx + 1 < VWORDS else
          LAST_MASK when swp = '1' and sw_idx + 1 = VWORDS else
          (others => '0') when swp = '1' else
          r_data when r_index + 1 < VWORDS else
          r_data and LAST_MASK;
  v_ra <= resize(r_index, VA);

  buf_copy : entity work.hf_ram
    generic map (WIDTH => 32, ADDR_W => BA)
    port map (clk => clk, we => b_we, waddr => b_wa, wdata => b_wd, raddr => b_ra, rdata => b_q);

  valid_copy : entity work.hf_ram
    generic map (WIDTH => 32, ADDR_W => VA)
    port map (clk => clk, we => v_we, waddr => v_wa, wdata => v_wd, raddr => v_ra, rdata => v_q);

  -- the valid mask, one register per VALID word: written when the host writes that word
  valid_words : for k in 0 to VWORDS - 1 generate
    constant LO : natural := 32 * k;
    constant HI : natural := minimum(32 * k + 31, N_STATIC - 1);
    signal v : std_logic_vector(HI - LO downto 0) := (others => '1');
  begin
    reg : process (clk)
    begin
      if rising_edge(clk) then
        if r_v = '1' and r_write = '1' and r_buf = '0' and r_index = k then
          v <= r_data(HI - LO downto 0);
        end if;
        if rst = '1' then
          v <= (others => '1');
        end if;
      end if;
    end process;
    vm(HI downto LO) <= v;
  end generate;
  no_entries : if N_STATIC = 0 generate
    vm <= (others => '1');
  end generate;

  none : if DEPTH = 0 generate
    win <= (others => '0');
    idx <= st_idx;
  end generate;

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
          if r_v = '1' and r_write = '1' and r_buf = '1' and r_index(23 downto 4) = b then
            if r_index(3 downto 0) = 0 then w0 <= r_data; end if;
            if r_index(3 downto 0) = 1 then w1 <= r_data; end if;
            if r_index(3 downto 0) = 2 then w2 <= r_data; end if;
            if r_index(3 downto 0) = 3 then w3 <= r_data; end if;
            if r_index(3 downto 0) = 4 then w4 <= r_data; end if;
            if r_index(3 downto 0) = 5 then w5 <= r_data; end if;
            if r_index(3 downto 0) = 6 then w6 <= r_data and WMASK(6); end if;
            if r_index(3 downto 0) = 7 then w7 <= r_data and WMASK(7); end if;
            if r_index(3 downto 0) = W_FLAGS then w8 <= r_data and WMASK(W_FLAGS); end if;
            if r_index(3 downto 0) = W_CONTROL then w9 <= r_data and WMASK(W_CONTROL); end if;
            if r_index(3 downto 0) = W_SETS then w10 <= r_data and WMASK(W_SETS); end if;
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

    static_line : process (clk)
    begin
      if rising_edge(clk) then
        sil(1) <= st_idx;
        for k in 2 to STAGES + 1 loop
          sil(k) <= sil(k - 1);
        end loop;
      end if;
    end process;

    encoder : entity work.hf_prio_enc
      generic map (N_IN => DEPTH, FANIN => FANIN, STAGES => STAGES, IDX_W => EW)
      port map (clk => clk, vec => win(DEPTH - 1 downto 0), any => e_any, idx => e_idx);

    idx <= to_unsigned(N_STATIC + 1, IDX_W) + resize(e_idx, IDX_W) when e_any = '1' else sil(STAGES + 1);
  end generate;
end architecture;

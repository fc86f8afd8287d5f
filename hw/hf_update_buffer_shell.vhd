-- What an SFL update buffer has besides its slots, shared by hf_update_buffer (IPv4) and hf_update_buffer6 (IPv6):
-- the host's access to its two tables (BUF and VALID, or BUF6 and VALID6: IND_ADDRESS = table << 24 | index), the
-- read-back copies of both in block RAM, swept to their reset values after power-on and every reset, the valid mask
-- (one register per VALID word), and the slot encoder that turns the slots' win bits into the hardware index. The
-- slots (their words' registers and tests) are the buffer's own: a host write to BUF reaches them as w_en, w_index
-- (slot << WORD_BITS | word) and w_data, and the buffer gives back the bits that word holds (w_mask), which the
-- read-back copy keeps too.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_update_buffer_shell is
  generic (
    N_STATIC  : natural;   -- static entries: bits of the valid mask
    DEPTH     : natural;   -- slots (0: the valid mask alone; idx is then st_idx)
    IDX_W     : positive;  -- bits of a hardware index (local to the buffer's entries)
    FANIN     : positive;  -- fan-in of the slot encoder (a power of two >= 2)
    STAGES    : positive;  -- its stages, the least s with FANIN ** s >= DEPTH
    WORD_BITS : positive;  -- the BUF index stride per slot is 2 ** WORD_BITS words
    USED      : positive;  -- words 0 .. USED - 1 of a slot are its own, the others read 0
    T_BUF     : natural    -- the table id of BUF in IND_ADDRESS (any other id: VALID)
  );
  port (
    clk       : in  std_logic;
    rst       : in  std_logic;  -- synchronous: every static entry valid, the copies swept
    valid     : out std_logic_vector(maximum(N_STATIC, 1) - 1 downto 0);  -- the valid mask, to the matcher
    st_idx    : in  unsigned(IDX_W - 1 downto 0);  -- the static index
    -- slot b may win (registered in st_idx's cycle: it matched the header, is enabled and placed no later)
    win       : in  std_logic_vector(maximum(DEPTH, 1) - 1 downto 0);
    -- the hardware index, 1 + STAGES cycles after st_idx (0 without slots): N_STATIC + 1 + the first b that wins
    idx       : out unsigned(IDX_W - 1 downto 0);
    w_en      : out std_logic;  -- the host writes BUF word w_index (at the end of this cycle)
    w_index   : out unsigned(23 downto 0);
    w_data    : out std_logic_vector(31 downto 0);
    w_mask    : in  std_logic_vector(31 downto 0);  -- the bits word w_index holds (its slots' mask)
    -- one request at a time, answered (ind_done) 3 cycles after it, later while the copies are swept
    ind_req   : in  std_logic;
    ind_write : in  std_logic;
    ind_addr  : in  std_logic_vector(31 downto 0);
    ind_wdata : in  std_logic_vector(31 downto 0);
    ind_done  : out std_logic;
    ind_rdata : out std_logic_vector(31 downto 0)
  );
end entity;

architecture rtl of hf_update_buffer_shell is
  constant VW : positive := maximum(N_STATIC, 1);
  constant VWORDS : natural := (N_STATIC + 31) / 32;
  constant SD : positive := maximum(DEPTH, 1);
  constant EW : positive := maximum(clog2(SD), 1);
  constant BA : positive := maximum(clog2(SD * 2 ** WORD_BITS), 1);  -- address bits of the BUF copy
  constant VA : positive := maximum(clog2(maximum(VWORDS, 1)), 1);  -- and of the VALID copy
  constant SWEEP : positive := maximum(2 ** BA, 2 ** VA);  -- cycles of the sweep that resets both copies

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
  signal e_any : std_logic;
  signal e_idx : unsigned(EW - 1 downto 0);
  type idx_line is array (1 to STAGES + 1) of unsigned(IDX_W - 1 downto 0);
  signal sil : idx_line := (others => (others => '0'));

  -- a request is taken (r_v) unless the sweep runs (then it waits: pend), writes land at the end of the r_v cycle,
  -- the copies answer a cycle later (r2_v), ind_done the cycle after
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
begin
  assert DEPTH = 0 or (FANIN ** STAGES >= DEPTH and (STAGES = 1 or FANIN ** (STAGES - 1) < DEPTH))
    report "hf_update_buffer_shell: STAGES is not the least s with FANIN ** s >= DEPTH" severity failure;
  assert USED <= 2 ** WORD_BITS report "hf_update_buffer_shell: USED words do not fit the stride" severity failure;

  valid <= vm;

  in_buf <= to_sl(r_buf = '1' and r_index(WORD_BITS - 1 downto 0) < USED and r_index(23 downto WORD_BITS) < DEPTH);
  in_valid <= to_sl(r_buf = '0' and r_index < VWORDS);
  w_en <= r_v and r_write and r_buf;
  w_index <= r_index;
  w_data <= r_data;

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
        r_buf <= to_sl(unsigned(ind_addr(31 downto 24)) = T_BUF);
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
  b_wd <= (others => '0') when swp = '1' else r_data and w_mask;
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
    idx <= st_idx;
  end generate;

  slots : if DEPTH > 0 generate
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

-- The per-entry tables: shunt vector (32 entries per word), action codes and hit counters, each a RAM
-- with one port for the classification path and one for indirect register access (IND_* registers). One row per
-- hardware index: the entries, the policy entry and the update buffer's slots (N_ROWS).
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;
use work.hf_policy_pkg.all;
use work.hf_regs_pkg.all;

entity hf_tables is
  port (
    clk        : in  std_logic;
    rst        : in  std_logic;
    -- lookup: match_index in, shunt bit and action one cycle later
    lk_idx     : in  unsigned(IDX_W - 1 downto 0);
    lk_shunt   : out std_logic;
    lk_action  : out std_logic_vector(3 downto 0);
    -- hit counting: one first-match per cycle at most
    hit_v      : in  std_logic;
    hit_idx    : in  unsigned(IDX_W - 1 downto 0);
    hits_clear : in  std_logic;  -- pulse: zero every hit counter (takes N_ROWS cycles)
    -- indirect access (IND_ADDRESS = table << 24 | index)
    ind_req    : in  std_logic;
    ind_write  : in  std_logic;
    ind_addr   : in  std_logic_vector(31 downto 0);
    ind_wdata  : in  std_logic_vector(31 downto 0);
    ind_done   : out std_logic;
    ind_rdata  : out std_logic_vector(31 downto 0);
    ready      : out std_logic  -- '0' while the reset sweep loads the policy's tables: lookups are not valid
  );
end entity;

architecture rtl of hf_tables is
  constant NE : natural := N_ROWS;
  -- memories are a power of two deep so that no address needs a range check on the fast path
  constant SW_W : natural := maximum(1, clog2(SHUNT_WORDS));
  constant NSW : natural := 2 ** SW_W;
  constant NEP : natural := 2 ** IDX_W;

  -- The memories (hf_ram) have no initial contents: GHDL synthesis does not carry a constant array's values into
  -- the netlist faithfully (the shunt table came out all zeros), so the policy's contents are loaded by the sweep
  -- below, and the hit counters are zeroed by theirs; both sweeps also run at power-on (st starts in RESTORE,
  -- clr_busy at '1') and after every reset.
  signal lk_bit : unsigned(4 downto 0) := (others => '0');
  signal lk_sw_addr : unsigned(SW_W - 1 downto 0);
  signal lk_word, ind_word : std_logic_vector(31 downto 0);
  signal lk_act, ind_act : std_logic_vector(3 downto 0);

  -- indirect access state
  type ind_state_t is (RESTORE, IDLE, ST_ACCESS, REPLY, HITS_WAIT, HITS_REPLY);
  signal st : ind_state_t := RESTORE;
  signal rdy : std_logic := '0';
  -- restore of the policy's table contents after reset: a sweep reading the package's case functions as a ROM
  signal rs_idx, rs_widx : unsigned(IDX_W - 1 downto 0) := (others => '0');
  signal rs_wv : std_logic := '0';
  signal pending : std_logic := '0';  -- a request that arrived while the tables were busy restoring
  signal rom_sw : std_logic_vector(31 downto 0) := (others => '0');
  signal rom_act : std_logic_vector(3 downto 0) := (others => '0');
  signal swp_we, actp_we : std_logic;
  signal swp_addr : unsigned(SW_W - 1 downto 0);
  signal actp_addr : unsigned(IDX_W - 1 downto 0);
  signal swp_data : std_logic_vector(31 downto 0);
  signal actp_data : std_logic_vector(3 downto 0);
  signal i_table : unsigned(7 downto 0) := (others => '0');
  signal i_index : unsigned(23 downto 0) := (others => '0');
  signal i_write : std_logic := '0';
  signal i_data, i_reply : std_logic_vector(31 downto 0) := (others => '0');
  signal i_done : std_logic := '0';
  signal sw_we, act_we : std_logic;
  signal sw_addr : unsigned(SW_W - 1 downto 0);
  signal act_addr : unsigned(IDX_W - 1 downto 0);

  -- hit counters: read, add one, write back; the write of the previous cycle is forwarded
  signal h0_v : std_logic := '0';
  signal h1_v : std_logic := '0';
  signal h1_idx : unsigned(IDX_W - 1 downto 0) := (others => '0');
  signal h_rd : std_logic_vector(31 downto 0);
  signal w_v : std_logic := '0';
  signal w_idx : unsigned(IDX_W - 1 downto 0) := (others => '0');
  signal w_val : unsigned(31 downto 0) := (others => '0');
  signal clr_busy : std_logic := '1';
  signal clr_idx : unsigned(IDX_W - 1 downto 0) := (others => '0');
  signal hr_addr : unsigned(IDX_W - 1 downto 0);
  signal hw_en : std_logic;
  signal hw_addr : unsigned(IDX_W - 1 downto 0);
  signal hw_data, h_cur : unsigned(31 downto 0);
  signal ind_hits_slot : std_logic;
begin
  assert SHUNT_DEPTH = NSW and ACTION_DEPTH = NEP
    report "hf_tables: policy package tables do not match IDX_W" severity failure;
  assert SHUNT_WORDS = (NE + 31) / 32 report "hf_tables: SHUNT_WORDS inconsistent with N_ROWS" severity failure;
  assert 2 ** IDX_W >= NE report "hf_tables: IDX_W too small" severity failure;

  in_range : block
  begin
    sw_addr <= resize(i_index, SW_W) when i_index < SHUNT_WORDS else (others => '0');
    act_addr <= resize(i_index, IDX_W) when i_index < NE else (others => '0');
    sw_we <= '1' when st = ST_ACCESS and i_write = '1' and i_table = TABLE_SHUNT and i_index < SHUNT_WORDS else '0';
    act_we <= '1' when st = ST_ACCESS and i_write = '1' and i_table = TABLE_ACTION and i_index < NE else '0';
  end block;

  -- one write port per table: indirect writes, or the restore sweep
  swp_we <= sw_we or (rs_wv and to_sl(rs_widx < NSW));
  swp_addr <= resize(rs_widx, SW_W) when rs_wv = '1' else sw_addr;
  swp_data <= rom_sw when rs_wv = '1' else i_data;
  actp_we <= act_we or rs_wv;
  actp_addr <= rs_widx when rs_wv = '1' else act_addr;
  actp_data <= rom_act when rs_wv = '1' else i_data(3 downto 0);

  rom : process (clk)
  begin
    if rising_edge(clk) then
      rom_sw <= shunt_init_word(to_integer(resize(rs_idx, SW_W)));
      rom_act <= action_init(to_integer(rs_idx));
      rs_widx <= rs_idx;
      rs_wv <= '0';
      if st = RESTORE then
        rs_wv <= '1';
        rs_idx <= rs_idx + 1;
      end if;
      if rst = '1' then
        rs_idx <= (others => '0');
        rs_wv <= '0';
      end if;
    end if;
  end process;

  -- shunt and action tables: one read port for lookups, one for indirect reads
  lk_sw_addr <= resize(shift_right(lk_idx, 5), SW_W);
  shunt_ram : entity work.hf_ram
    generic map (WIDTH => 32, ADDR_W => SW_W, READS => 2)
    port map (clk => clk, we => swp_we, waddr => swp_addr, wdata => swp_data, raddr => lk_sw_addr & sw_addr,
              rdata(63 downto 32) => lk_word, rdata(31 downto 0) => ind_word);

  action_ram : entity work.hf_ram
    generic map (WIDTH => 4, ADDR_W => IDX_W, READS => 2)
    port map (clk => clk, we => actp_we, waddr => actp_addr, wdata => actp_data, raddr => lk_idx & act_addr,
              rdata(7 downto 4) => lk_act, rdata(3 downto 0) => ind_act);

  lk_reg : process (clk)
  begin
    if rising_edge(clk) then
      lk_bit <= resize(lk_idx, 5);
    end if;
  end process;
  lk_shunt <= lk_word(to_integer(lk_bit));
  lk_action <= lk_act;

  -- hit counting: H0 reads, H1 adds (with forwarding of the write issued in the same cycle as the read)
  ind_hits_slot <= '1' when hit_v = '0' and clr_busy = '0' and st = HITS_WAIT else '0';
  hr_addr <= hit_idx when hit_v = '1' else resize(i_index, IDX_W);
  h_cur <= w_val when w_v = '1' and w_idx = h1_idx else unsigned(h_rd);
  hw_en <= clr_busy or h1_v;
  hw_addr <= clr_idx when clr_busy = '1' else h1_idx;
  hw_data <= (others => '0') when clr_busy = '1' else h_cur + 1;

  hits_ram : entity work.hf_ram
    generic map (WIDTH => 32, ADDR_W => IDX_W)
    port map (clk => clk, we => hw_en, waddr => hw_addr, wdata => std_logic_vector(hw_data), raddr => hr_addr,
              rdata => h_rd);

  hits_ctrl : process (clk)
  begin
    if rising_edge(clk) then
      h1_v <= hit_v and not clr_busy;
      h1_idx <= hit_idx;
      w_v <= hw_en;
      w_idx <= hw_addr;
      w_val <= hw_data;
      if clr_busy = '1' then
        if clr_idx = NE - 1 then
          clr_busy <= '0';
        end if;
        clr_idx <= clr_idx + 1;
      end if;
      if hits_clear = '1' then
        clr_busy <= '1';
        clr_idx <= (others => '0');
      end if;
      if rst = '1' then
        h1_v <= '0';
        w_v <= '0';
        clr_busy <= '1';  -- counters start at zero after every reset, not only at configuration
        clr_idx <= (others => '0');
      end if;
    end if;
  end process;

  indirect : process (clk)
  begin
    if rising_edge(clk) then
      i_done <= '0';
      if ind_req = '1' and st /= IDLE then
        pending <= '1';
      end if;
      case st is
        when RESTORE =>
          if rs_idx = NEP - 1 then
            st <= IDLE;
          end if;
        when IDLE =>
          pending <= '0';
          if ind_req = '1' or pending = '1' then
            i_table <= unsigned(ind_addr(31 downto 24));
            i_index <= unsigned(ind_addr(23 downto 0));
            i_write <= ind_write;
            i_data <= ind_wdata;
            if unsigned(ind_addr(31 downto 24)) = TABLE_HITS and ind_write = '0'
               and unsigned(ind_addr(23 downto 0)) < NE then
              st <= HITS_WAIT;
            else
              st <= ST_ACCESS;
            end if;
          end if;
        when ST_ACCESS =>
          st <= REPLY;  -- writes happen in this cycle, reads are registered
        when REPLY =>
          i_reply <= (others => '0');
          if i_table = TABLE_SHUNT and i_index < SHUNT_WORDS then
            i_reply <= ind_word;
          elsif i_table = TABLE_ACTION and i_index < NE then
            i_reply <= x"0000000" & ind_act;
          end if;
          i_done <= '1';
          st <= IDLE;
        when HITS_WAIT =>
          if ind_hits_slot = '1' then
            st <= HITS_REPLY;
          end if;
        when HITS_REPLY =>
          i_reply <= h_rd;
          i_done <= '1';
          st <= IDLE;
      end case;
      if rst = '1' then
        pending <= '0';
        st <= RESTORE;  -- tables return to the generated policy's contents on every reset
      end if;
    end if;
  end process;

  -- ready one cycle after the last sweep write, so that the first lookup it admits reads restored contents
  ready_reg : process (clk)
  begin
    if rising_edge(clk) then
      rdy <= to_sl(st /= RESTORE and rs_wv = '0');
      if rst = '1' then
        rdy <= '0';
      end if;
    end if;
  end process;
  ready <= rdy;

  ind_done <= i_done;
  ind_rdata <= i_reply;
end architecture;

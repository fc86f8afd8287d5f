-- AXI4-Lite register block of the core: the registers of hw/regmap.txt (offsets from the generated
-- hf_regs_pkg), event counters, the SUME indirect-access protocol to the per-entry tables, and the flow cache's
-- command registers (FC_KEY0..9, FC_SLOT, FC_CMD: a write of FC_CMD pulses fc_cmd unless FC_STATUS bit 31, busy,
-- is set) with its read-back registers, whose values the core supplies (0 when it has no flow cache), and the policy
-- sync lease (LEASE, LEASE_STATUS): a count of ticks the host re-arms while its policy sync service runs; armed and
-- run down to 0 it has expired (lease_expired), and the core then decides no wire frame.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;
use work.hf_regs_pkg.all;
use work.hf_policy_pkg.all;

entity hf_regs is
  generic (
    ADDR_WIDTH : positive := 12  -- AXI4-Lite address bits (4 KB window)
  );
  port (
    clk           : in  std_logic;
    rst           : in  std_logic;
    s_axi_awaddr  : in  std_logic_vector(ADDR_WIDTH - 1 downto 0);
    s_axi_awvalid : in  std_logic;
    s_axi_awready : out std_logic;
    s_axi_wdata   : in  std_logic_vector(31 downto 0);
    s_axi_wstrb   : in  std_logic_vector(3 downto 0);
    s_axi_wvalid  : in  std_logic;
    s_axi_wready  : out std_logic;
    s_axi_bresp   : out std_logic_vector(1 downto 0);
    s_axi_bvalid  : out std_logic;
    s_axi_bready  : in  std_logic;
    s_axi_araddr  : in  std_logic_vector(ADDR_WIDTH - 1 downto 0);
    s_axi_arvalid : in  std_logic;
    s_axi_arready : out std_logic;
    s_axi_rdata   : out std_logic_vector(31 downto 0);
    s_axi_rresp   : out std_logic_vector(1 downto 0);
    s_axi_rvalid  : out std_logic;
    s_axi_rready  : in  std_logic;
    -- to the datapath
    generation    : out std_logic_vector(15 downto 0);
    control       : out std_logic_vector(31 downto 0);
    -- events: one pulse vector per frame leaving the core (EV_* bits), plus frames sent
    ev_valid      : in  std_logic;
    ev_bits       : in  std_logic_vector(EV_W - 1 downto 0);
    ev_sent       : in  std_logic;
    ev_fifo_drop  : in  std_logic;
    -- tables
    hits_clear    : out std_logic;
    ind_req       : out std_logic;
    ind_write     : out std_logic;
    ind_addr      : out std_logic_vector(31 downto 0);
    ind_wdata     : out std_logic_vector(31 downto 0);
    ind_done      : in  std_logic;
    ind_rdata     : in  std_logic_vector(31 downto 0);
    -- flow cache: command (fc_cmd pulses for one cycle with fc_op, the key and the slot) and read-back values
    fc_cmd        : out std_logic;
    fc_op         : out std_logic_vector(2 downto 0);
    fc_key0       : out std_logic_vector(31 downto 0);
    fc_key1       : out std_logic_vector(31 downto 0);
    fc_key2       : out std_logic_vector(31 downto 0);
    fc_key3       : out std_logic_vector(31 downto 0);
    fc_key_hi     : out std_logic_vector(191 downto 0);  -- FC_KEY9 & .. & FC_KEY4 (an IPv6 key's upper bits)
    fc_slot       : out std_logic_vector(23 downto 0);
    fc_status     : in  std_logic_vector(31 downto 0) := (others => '0');
    fc_config     : in  std_logic_vector(31 downto 0) := (others => '0');
    fc_now        : in  std_logic_vector(31 downto 0) := (others => '0');
    fc_occupancy  : in  std_logic_vector(31 downto 0) := (others => '0');
    fc_inserts    : in  std_logic_vector(31 downto 0) := (others => '0');
    fc_deletes    : in  std_logic_vector(31 downto 0) := (others => '0');
    fc_full       : in  std_logic_vector(31 downto 0) := (others => '0');
    -- lease: ticks elapsed in this cycle (usually 0 or 1; the emulator's harness gives what wall time owes at once)
    lease_ticks   : in  std_logic_vector(31 downto 0) := (others => '0');
    lease_expired : out std_logic;
    -- [ctm] registers 0xC0-0xDC live in the core (hypafilter_core's ctm block): a write there pulses x_wr with the
    -- register's number (offset - 0xC0) / 4; a read returns word x of x_rdata
    x_wr          : out std_logic;
    x_waddr       : out std_logic_vector(2 downto 0);
    x_wdata       : out std_logic_vector(31 downto 0);
    x_rdata       : in  std_logic_vector(255 downto 0) := (others => '0')
  );
end entity;

architecture rtl of hf_regs is
  signal r_flip, r_debug, r_ind_addr, r_ind_wdata, r_ind_reply : std_logic_vector(31 downto 0) := (others => '0');
  signal r_gen : std_logic_vector(31 downto 0) := REG_GENERATION_RESET;
  signal r_control : std_logic_vector(31 downto 0) := REG_CONTROL_RESET;
  signal r_ind_busy, r_ind_rd, r_ind_stream : std_logic := '0';
  signal wr_stall : std_logic;
  signal r_fc_key0, r_fc_key1, r_fc_key2, r_fc_key3 : std_logic_vector(31 downto 0) := (others => '0');
  signal r_fc_key_hi : std_logic_vector(191 downto 0) := (others => '0');  -- FC_KEY4..9 (a core without IPv6 keys
                                                                          -- leaves them unread: trimmed)
  signal r_fc_slot : std_logic_vector(23 downto 0) := (others => '0');
  signal r_fc_op : std_logic_vector(2 downto 0) := (others => '0');
  signal r_fc_cmd : std_logic := '0';
  -- the lease: ticks left, armed (a non-zero write), expiries since reset (saturating at 16 bits)
  signal r_lease : unsigned(31 downto 0) := (others => '0');
  signal r_lease_armed : std_logic := '0';
  signal r_lease_exp : std_logic := '0';
  signal r_lease_expiries : unsigned(15 downto 0) := (others => '0');
  signal r_x_wr : std_logic := '0';  -- [ctm]
  signal r_x_waddr : std_logic_vector(2 downto 0) := (others => '0');
  signal r_x_wdata : std_logic_vector(31 downto 0) := (others => '0');
  signal x_word : std_logic_vector(31 downto 0);
  signal x_whit, x_rhit : std_logic;
  signal x_widx : std_logic_vector(2 downto 0);
  -- The event counters: each counts the cycles in which its bit of evx is set. evx is ev_bits (EV_* positions)
  -- while ev_valid, then ev_sent while ev_valid, then ev_fifo_drop (its own pulse).
  constant EVX_SENT : natural := EV_W;
  constant EVX_FIFO_DROP : natural := EV_W + 1;
  type counter_t is record
    reg : natural;  -- its register
    ev : natural;   -- its bit of evx
  end record;
  type counters_t is array (natural range <>) of counter_t;
  constant COUNTERS : counters_t := (
    (REG_PKTIN, EV_WIRE), (REG_PKTOUT, EVX_SENT), (REG_CNT_FORWARDED, EV_FORWARDED), (REG_CNT_DROPPED, EV_DROPPED),
    (REG_CNT_SHUNT_OVERRULE, EV_OVERRULE), (REG_CNT_SHUNT_POLICY, EV_POLICY), (REG_CNT_SHUNT_UNPARSED, EV_UNPARSED),
    (REG_CNT_FROM_HOST, EV_FROM_HOST), (REG_CNT_SHUNT_FORCED, EV_FORCED), (REG_CNT_FIFO_DROP, EVX_FIFO_DROP),
    (REG_CNT_DROP_UNFILTERABLE, EV_UNFILTERABLE), (REG_CNT_SHUNT_STATE, EV_STATE),
    (REG_CNT_MIRROR, EV_MIRROR), (REG_CNT_SET_UNCERTAIN, EV_SET_UNC));
  type count_arr is array (COUNTERS'range) of unsigned(31 downto 0);
  signal counts : count_arr := (others => (others => '0'));
  signal evx : std_logic_vector(EV_W + 1 downto 0);
  signal clear_cnt : std_logic := '0';
  signal bvalid, rvalid : std_logic := '0';
  signal rdata : std_logic_vector(31 downto 0) := (others => '0');
  signal req : std_logic := '0';
  signal wr_fire, rd_fire : std_logic;
  signal waddr, raddr : natural range 0 to 2 ** ADDR_WIDTH - 1;
begin
  assert ADDR_WIDTH >= 8 report "hf_regs: ADDR_WIDTH must cover the register map (>= 8)" severity failure;

  -- a write takes address and data together; one transaction at a time keeps the slave simple. In stream mode a
  -- write of IND_WR_DATA waits (no awready/wready) while the previous table write is still busy.
  wr_stall <= '1' when r_ind_stream = '1' and r_ind_busy = '1' and waddr = REG_IND_WR_DATA else '0';
  wr_fire <= s_axi_awvalid and s_axi_wvalid and not bvalid and not wr_stall;
  rd_fire <= s_axi_arvalid and not rvalid;
  s_axi_awready <= wr_fire;
  s_axi_wready <= wr_fire;
  s_axi_arready <= rd_fire;
  s_axi_bvalid <= bvalid;
  s_axi_bresp <= "00";
  s_axi_rvalid <= rvalid;
  s_axi_rresp <= "00";
  s_axi_rdata <= rdata;
  waddr <= to_integer(unsigned(s_axi_awaddr(ADDR_WIDTH - 1 downto 2))) * 4;
  raddr <= to_integer(unsigned(s_axi_araddr(ADDR_WIDTH - 1 downto 2))) * 4;

  write_side : process (clk)
  begin
    if rising_edge(clk) then
      req <= '0';
      clear_cnt <= '0';
      r_fc_cmd <= '0';
      r_x_wr <= '0';
      if bvalid = '1' and s_axi_bready = '1' then
        bvalid <= '0';
      end if;
      -- the lease runs down by the ticks of this cycle, stopping at 0; a write of LEASE below wins over them
      if r_lease > unsigned(lease_ticks) then
        r_lease <= r_lease - unsigned(lease_ticks);
      else
        r_lease <= (others => '0');
        if r_lease_armed = '1' and r_lease /= 0 and r_lease_expiries /= x"FFFF" then
          r_lease_expiries <= r_lease_expiries + 1;
        end if;
      end if;
      if ind_done = '1' then
        r_ind_busy <= '0';
        r_ind_reply <= ind_rdata;
        if r_ind_stream = '1' then  -- stream mode: the next data word goes to the next index
          r_ind_addr(23 downto 0) <= std_logic_vector(unsigned(r_ind_addr(23 downto 0)) + 1);
        end if;
      end if;
      if wr_fire = '1' then
        bvalid <= '1';
        -- One `if` per register, not a case: GHDL 2.0's Verilog netlist drops a case's `when others`, and the
        -- register case's `others => null` (hold) became a latch in the emulator's model: a write of an address
        -- outside the case (the CTM registers, 0xC0-0xDC) loaded every register of the case with the mux's
        -- stale value, e.g. CONTROL with the data of the bus's last write (issue #24: CONTROL read 0 on the
        -- 11,100-entry core after the flow sync service renewed CTM_LEASE). The addresses are distinct constants:
        -- the same registers as the case, a compare and a multiplexer each.
        if waddr = REG_RESET then
          clear_cnt <= s_axi_wdata(0);
        end if;
        if waddr = REG_FLIP then
          r_flip <= s_axi_wdata;
        end if;
        if waddr = REG_DEBUG then
          r_debug <= s_axi_wdata;
        end if;
        if waddr = REG_IND_ADDRESS then
          r_ind_addr <= s_axi_wdata;
        end if;
        if waddr = REG_IND_WR_DATA then
          r_ind_wdata <= s_axi_wdata;
          if r_ind_stream = '1' then  -- not busy here (wr_stall): this word is a table write
            r_ind_rd <= '0';
            r_ind_busy <= '1';
            req <= '1';
          end if;
        end if;
        if waddr = REG_IND_COMMAND then
          r_ind_rd <= s_axi_wdata(4);
          r_ind_stream <= s_axi_wdata(8);
          if s_axi_wdata(0) = '1' and r_ind_busy = '0' then
            r_ind_busy <= '1';
            req <= '1';
          end if;
        end if;
        if waddr = REG_GENERATION then
          r_gen <= s_axi_wdata;
        end if;
        if waddr = REG_CONTROL then
          r_control <= s_axi_wdata;
        end if;
        if waddr = REG_LEASE then
          r_lease <= unsigned(s_axi_wdata);
          r_lease_armed <= to_sl(unsigned(s_axi_wdata) /= 0);
        end if;
        if waddr = REG_FC_KEY0 then
          r_fc_key0 <= s_axi_wdata;
        end if;
        if waddr = REG_FC_KEY1 then
          r_fc_key1 <= s_axi_wdata;
        end if;
        if waddr = REG_FC_KEY2 then
          r_fc_key2 <= s_axi_wdata;
        end if;
        if waddr = REG_FC_KEY3 then
          r_fc_key3 <= s_axi_wdata;
        end if;
        for i in 0 to 5 loop  -- FC_KEY4..9: consecutive words
          if waddr = REG_FC_KEY4 + 4 * i then
            r_fc_key_hi(32 * i + 31 downto 32 * i) <= s_axi_wdata;
          end if;
        end loop;
        if waddr = REG_FC_SLOT then
          r_fc_slot <= s_axi_wdata(23 downto 0);
        end if;
        if waddr = REG_FC_CMD then
          r_fc_op <= s_axi_wdata(2 downto 0);
          r_fc_cmd <= not fc_status(31);  -- ignored while the last command runs
        end if;
        r_x_wr <= x_whit;  -- [ctm] (x_whit: 0 outside 0xC0-0xDC)
        r_x_waddr <= x_widx;
        r_x_wdata <= s_axi_wdata;
      end if;
      if rst = '1' then
        bvalid <= '0';
        req <= '0';
        r_fc_cmd <= '0';
        r_x_wr <= '0';
        r_ind_busy <= '0';
        r_ind_stream <= '0';
        r_gen <= REG_GENERATION_RESET;
        r_control <= REG_CONTROL_RESET;
        r_lease <= (others => '0');
        r_lease_armed <= '0';
        r_lease_expiries <= (others => '0');
        r_flip <= (others => '0');
        r_debug <= (others => '0');
      end if;
    end if;
  end process;

  -- [ctm] which register of 0xC0-0xDC is accessed, outside the processes: GHDL 2.0's Verilog drops assignments in
  -- the register case's others branch (the emulator read the previous word there, and no write reached the core)
  x_write : process (waddr)
  begin
    x_whit <= '0';
    x_widx <= (others => '0');
    for i in 0 to 7 loop
      if waddr = REG_CTM_CONTROL + 4 * i then
        x_whit <= '1';
        x_widx <= std_logic_vector(to_unsigned(i, 3));
      end if;
    end loop;
  end process;

  x_read : process (raddr, x_rdata)
  begin
    x_word <= (others => '0');
    x_rhit <= '0';
    for i in 0 to 7 loop
      if raddr = REG_CTM_CONTROL + 4 * i then
        x_rhit <= '1';
        x_word <= x_rdata(32 * i + 31 downto 32 * i);
      end if;
    end loop;
  end process;

  evx <= ev_fifo_drop & (ev_valid and ev_sent) & (ev_bits and (ev_bits'range => ev_valid));

  count : process (clk)
  begin
    if rising_edge(clk) then
      for i in COUNTERS'range loop
        if evx(COUNTERS(i).ev) = '1' then
          counts(i) <= counts(i) + 1;
        end if;
      end loop;
      if clear_cnt = '1' or rst = '1' then
        counts <= (others => (others => '0'));
      end if;
    end if;
  end process;

  read_side : process (clk)
    variable cnt_word : std_logic_vector(31 downto 0);
    variable cnt_sel : boolean;
  begin
    if rising_edge(clk) then
      if rvalid = '1' and s_axi_rready = '1' then
        rvalid <= '0';
      end if;
      if rd_fire = '1' then
        rvalid <= '1';
        case raddr is
          when REG_ID => rdata <= REG_ID_RESET;
          when REG_VERSION => rdata <= REG_VERSION_RESET;
          when REG_FLIP => rdata <= not r_flip;
          when REG_DEBUG => rdata <= r_debug;
          when REG_IND_ADDRESS => rdata <= r_ind_addr;
          when REG_IND_WR_DATA => rdata <= r_ind_wdata;
          when REG_IND_REPLY => rdata <= r_ind_reply;
          when REG_IND_COMMAND => rdata <= (8 => r_ind_stream, 4 => r_ind_rd, 0 => r_ind_busy, others => '0');
          when REG_IND_CONFIG => rdata <= std_logic_vector(to_unsigned(N_ROWS, 32));
          when REG_GENERATION => rdata <= r_gen;
          when REG_CONTROL => rdata <= r_control;
          when REG_NUM_ENTRIES => rdata <= std_logic_vector(to_unsigned(N_ENTRIES, 32));
          when REG_MATCHER_HASH => rdata <= MATCHER_HASH;
          when REG_BUF_CONFIG => rdata <= std_logic_vector(to_unsigned(BUF_DEPTH + 16 * 65536 + 11 * 16777216, 32));
          when REG_BUF6_CONFIG =>
            if V6_ON then
              rdata <= std_logic_vector(to_unsigned(BUF6_DEPTH + 32 * 65536 + 23 * 16777216, 32));
            else
              rdata <= (others => '0');
            end if;
          when REG_FC_STATUS => rdata <= fc_status;
          when REG_FC_CONFIG => rdata <= fc_config;
          when REG_FC_NOW => rdata <= fc_now;
          when REG_FC_OCCUPANCY => rdata <= fc_occupancy;
          when REG_FC_INSERTS => rdata <= fc_inserts;
          when REG_FC_DELETES => rdata <= fc_deletes;
          when REG_FC_FULL => rdata <= fc_full;
          when REG_LEASE => rdata <= std_logic_vector(r_lease);
          when REG_SET_CONFIG => rdata <= std_logic_vector(to_unsigned(N_SET_SLOTS + 256 * SET_LATENCY + 65536 * N_SET6_SLOTS, 32));
          when REG_LEASE_STATUS =>
            rdata <= std_logic_vector(r_lease_expiries) & (15 downto 2 => '0') & r_lease_exp & r_lease_armed;
          when others => rdata <= (others => '0');
        end case;
        -- the counters' registers, after the case: GHDL 2.0's Verilog netlist (the yosys estimate) drops the value
        -- of a case's `when others`, which lost the counters when they were read there. An OR of the (distinct)
        -- registers' words, not a chain of ifs, keeps the selection flat.
        cnt_word := (others => '0');
        cnt_sel := false;
        for i in COUNTERS'range loop
          if raddr = COUNTERS(i).reg then
            cnt_word := cnt_word or std_logic_vector(counts(i));
            cnt_sel := true;
          end if;
        end loop;
        if cnt_sel then
          rdata <= cnt_word;
        end if;
        if x_rhit = '1' then  -- [ctm]
          rdata <= x_word;
        end if;
      end if;
      if rst = '1' then
        rvalid <= '0';
      end if;
    end if;
  end process;

  -- registered: the datapath sees an expiry (and a re-arm) one cycle after the counter does
  lease_state : process (clk)
  begin
    if rising_edge(clk) then
      r_lease_exp <= r_lease_armed and to_sl(r_lease = 0);
      if rst = '1' then
        r_lease_exp <= '0';
      end if;
    end if;
  end process;
  lease_expired <= r_lease_exp;

  generation <= r_gen(15 downto 0);
  control <= r_control;
  hits_clear <= clear_cnt;
  ind_req <= req;
  ind_write <= not r_ind_rd;
  ind_addr <= r_ind_addr;
  ind_wdata <= r_ind_wdata;
  fc_cmd <= r_fc_cmd;
  fc_op <= r_fc_op;
  fc_key0 <= r_fc_key0;
  fc_key1 <= r_fc_key1;
  fc_key2 <= r_fc_key2;
  fc_key3 <= r_fc_key3;
  fc_key_hi <= r_fc_key_hi;
  fc_slot <= r_fc_slot;
  x_wr <= r_x_wr;
  x_waddr <= r_x_waddr;
  x_wdata <= r_x_wdata;
end architecture;

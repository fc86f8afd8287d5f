-- The conntrack membership structure (docs/flowsync.md, "New flows on the NIC"): a counting Bloom filter of the
-- canonical keys of every conntrack entry's tuples, written by the host (the flow sync service), and a table of
-- recent egress times written by the frames the host sends out, looked up at one header per cycle. A frame whose key
-- is in neither is one conntrack holds no entry for (the core then gives it ct 3 while the host says the filter is
-- complete). Every error is a false positive ("possible member"): saturated counters stay, a delete that finds a
-- counter at 0 changes nothing, a sweep answers "member" for every lookup.
-- IPv6 (V6, a dual-stack core): an IPv6 tuple's key is its addresses folded to 32 bits each (the XOR of their four
-- 32-bit words) in the same 104-bit key, hashed behind a family byte 1 (the CRCs of the 14 bytes: the same XOR
-- columns, other constants), so it meets an IPv4 key or another IPv6 key only by a collision (a false positive). A
-- host command carries the folded addresses (h_v6); a lookup or egress frame the full ones (lk_v6, *_hi). An IPv6
-- frame whose ports the core does not know (eg_u6: the walk refused it), a host frame or a wire frame the core hands
-- the host, makes every IPv6 lookup between its two addresses (either direction, any ports) a possible member for a
-- window: its time goes to a table of 2**U6_LOG2 stamps at a symmetric hash of the folded addresses (a collision is
-- a false positive).
-- Shunt stamps (the core's decision): a wire frame with a key that the core hands the host writes the time at the
-- egress index its lookup gave (res_eidx); a frame at the decision reads its own (ck_idx, ck_recent a cycle later): a
-- frame with ct 3 whose key went to the host less than a window ago is not decided (docs/flowsync.md, "A frame of the
-- reverse tuple right behind the first frame").
--
-- Definitions (key, hashes, counters, stamps, command codes) are those of mgmt/hypafilter/hw/ctmember.py:
--   key = the flow cache's canonical key (104 bits, both directions one key); IPv6: of the folded addresses;
--   bank b's counter: CRC-32 (b = 0, 2) or CRC-32C (b = 1, 3) of the key's 13 bytes (IPv6: 0x01 and the 13 bytes),
--     most significant first; low
--     LOG2 bits for banks 0/1, high LOG2 bits for banks 2/3; counters of 4 bits, 15 sticky;
--   egress index: bits 8 .. 8 + EGRESS_LOG2 - 1 of CRC-32 xor CRC-32C; stamp = the 32-bit tick count (1 ms);
--     recent while now - stamp < window (mod 2**32);
--   [V6] unknown-ports index (unknown6_index): x = folded src xor folded dst xor (their sum mod 2**32 rotated left
--     by 13), the XOR of x's four bytes.
-- Memories: per bank a RAM of 2**LOG2 counters (read port 0 lookups; read port 1 and the write port, on one address,
-- the host's read-modify-write and the sweeps: a block RAM's second port, so synthesis keeps one copy), the egress
-- stamps (read port lookups, write port egress frames and the reset sweep), [V6] the unknown-ports stamps (the same
-- ports, eg_u6 frames), the shunt stamps (write port the decision's sh_*, read port its ck_idx). The sweep after
-- reset zeroes every counter and stamp; a clear command's sweep the counters only.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_ct_member is
  generic (
    LOG2        : natural := 14;  -- counters per bank = 2**LOG2 (8..24)
    EGRESS_LOG2 : natural := 12;  -- egress stamps = 2**EGRESS_LOG2 (4..24)
    V6          : boolean := false  -- IPv6 keys too (a dual-stack core); false: the IPv4-only design
  );
  port (
    clk        : in  std_logic;
    rst        : in  std_logic;
    -- one header per cycle: lk_valid looks it up (a wire frame), eg_valid records it as egress (a host frame)
    lk_valid   : in  std_logic;
    eg_valid   : in  std_logic;
    lk_src_ip  : in  std_logic_vector(31 downto 0);
    lk_dst_ip  : in  std_logic_vector(31 downto 0);
    lk_proto   : in  std_logic_vector(7 downto 0);
    lk_sport   : in  std_logic_vector(15 downto 0);
    lk_dport   : in  std_logic_vector(15 downto 0);
    -- [V6] an IPv6 header: lk_*_ip are its addresses' bits 31:0, lk_*_hi bits 127:32 (folded here)
    lk_v6      : in  std_logic := '0';
    lk_src_hi  : in  std_logic_vector(95 downto 0) := (others => '0');
    lk_dst_hi  : in  std_logic_vector(95 downto 0) := (others => '0');
    -- [V6] an IPv6 frame whose ports are unknown (a host frame, or a refused wire frame), its addresses on lk_*_ip and
    -- lk_*_hi (lk_v6 not read): every IPv6 lookup between the same two addresses a possible member for a window after
    -- it
    eg_u6      : in  std_logic := '0';
    -- LATENCY = 4 cycles after the header: a possible member (all counters non-zero, a recent egress, or a sweep)
    res_valid  : out std_logic;
    res_member : out std_logic;
    res_egress : out std_logic;  -- the recent-egress part of it
    res_eidx   : out std_logic_vector(23 downto 0);  -- the lookup's stamp index (low EGRESS_LOG2 bits), with res_*
    -- shunt stamps: a wire frame the core hands the host (sh_valid, its lookup's res_eidx) writes the time at its
    -- index; ck_idx (a frame at the decision) reads them: ck_recent one cycle later, whether a frame of that index
    -- went to the host less than `window` ago, the write of the cycle of the read included
    sh_valid   : in  std_logic := '0';
    sh_idx     : in  std_logic_vector(23 downto 0) := (others => '0');
    ck_idx     : in  std_logic_vector(23 downto 0) := (others => '0');
    ck_recent  : out std_logic;
    ticks      : in  std_logic_vector(31 downto 0);  -- ticks (1 ms) elapsed in this cycle
    window     : in  std_logic_vector(15 downto 0);  -- egress life in ticks
    -- host commands: taken in a cycle with h_valid = h_ready = '1'; 1 insert, 2 delete, 3 clear
    h_valid    : in  std_logic;
    h_ready    : out std_logic;
    h_op       : in  std_logic_vector(1 downto 0);
    h_src_ip   : in  std_logic_vector(31 downto 0);
    h_dst_ip   : in  std_logic_vector(31 downto 0);
    h_proto    : in  std_logic_vector(7 downto 0);
    h_sport    : in  std_logic_vector(15 downto 0);
    h_dport    : in  std_logic_vector(15 downto 0);
    h_v6       : in  std_logic := '0';  -- [V6] an IPv6 key: h_*_ip are the folded addresses
    members    : out std_logic_vector(31 downto 0);  -- inserts minus deletes done since the last clear
    saturated  : out std_logic_vector(31 downto 0);  -- counters an insert made sticky
    refused    : out std_logic_vector(31 downto 0);  -- deletes refused (a counter of the key was 0)
    ready      : out std_logic   -- '0' during a sweep (every lookup answers "member")
  );
end entity;

architecture rtl of hf_ct_member is
  constant KEY_W : natural := 104;
  constant CW : natural := 4;
  constant CMAX : unsigned(CW - 1 downto 0) := (others => '1');
  constant NB : natural := 4;
  constant EW : natural := EGRESS_LOG2;
  constant U6_LOG2 : natural := 8;  -- [V6] unknown-ports stamps (ctmember.UNKNOWN6_LOG2); LOG2 >= 8: the sweep covers them
  constant SW_W : natural := maximum(LOG2, EW);

  subtype key_t is std_logic_vector(KEY_W - 1 downto 0);
  subtype w32 is std_logic_vector(31 downto 0);
  type cols_t is array (0 to KEY_W - 1) of w32;
  type idx_arr is array (0 to NB - 1) of unsigned(LOG2 - 1 downto 0);
  type cnt_arr is array (0 to NB - 1) of unsigned(CW - 1 downto 0);

  -- a reflected CRC (initial value and final xor all ones) of the key's bytes, most significant first
  function crc_loop(k : key_t; poly : w32) return w32 is
    variable c : w32 := (others => '1');
  begin
    for i in KEY_W / 8 - 1 downto 0 loop
      c(7 downto 0) := c(7 downto 0) xor k(8 * i + 7 downto 8 * i);
      for b in 0 to 7 loop
        c := ('0' & c(31 downto 1)) xor (poly and (31 downto 0 => c(0)));
      end loop;
    end loop;
    return not c;
  end function;

  -- the CRC is affine in the key: an XOR reduction per output bit (a balanced tree), not the 104-step chain
  function columns(poly : w32) return cols_t is
    variable r : cols_t;
    variable e : key_t;
  begin
    for i in 0 to KEY_W - 1 loop
      e := (others => '0');
      e(i) := '1';
      r(i) := crc_loop(e, poly) xor crc_loop((others => '0'), poly);
    end loop;
    return r;
  end function;
  constant POLY_A : w32 := x"EDB88320";  -- CRC-32 (zlib)
  constant POLY_C : w32 := x"82F63B78";  -- CRC-32C (Castagnoli)
  constant COLS_A : cols_t := columns(POLY_A);
  constant COLS_C : cols_t := columns(POLY_C);
  constant ZERO_A : w32 := crc_loop((others => '0'), POLY_A);
  constant ZERO_C : w32 := crc_loop((others => '0'), POLY_C);
  -- an IPv6 key's CRCs: of the family byte 1 and the key; linear in the key as IPv4's, only the constant differs
  function crc6_zero(poly : w32) return w32 is
    variable c : w32 := (others => '1');
    variable k : std_logic_vector(KEY_W + 7 downto 0) := (others => '0');
  begin
    k(KEY_W) := '1';
    for i in k'length / 8 - 1 downto 0 loop
      c(7 downto 0) := c(7 downto 0) xor k(8 * i + 7 downto 8 * i);
      for b in 0 to 7 loop
        c := ('0' & c(31 downto 1)) xor (poly and (31 downto 0 => c(0)));
      end loop;
    end loop;
    return not c;
  end function;
  constant ZERO6_A : w32 := crc6_zero(POLY_A);
  constant ZERO6_C : w32 := crc6_zero(POLY_C);

  function base_a(is6 : std_logic) return w32 is
  begin
    if V6 and is6 = '1' then
      return ZERO6_A;
    end if;
    return ZERO_A;
  end function;

  function base_c(is6 : std_logic) return w32 is
  begin
    if V6 and is6 = '1' then
      return ZERO6_C;
    end if;
    return ZERO_C;
  end function;

  -- an IPv6 address folded to 32 bits (lo: bits 31:0, hi: bits 127:32)
  function fold(lo : w32; hi : std_logic_vector(95 downto 0); is6 : std_logic) return w32 is
  begin
    if V6 and is6 = '1' then
      return lo xor hi(31 downto 0) xor hi(63 downto 32) xor hi(95 downto 64);
    end if;
    return lo;
  end function;

  function crc(k : key_t; cols : cols_t; zero : w32) return w32 is
    variable r : w32;
    variable m : key_t;
  begin
    for j in 0 to 31 loop
      for i in 0 to KEY_W - 1 loop
        m(i) := cols(i)(j);
      end loop;
      r(j) := (xor (k and m)) xor zero(j);
    end loop;
    return r;
  end function;

  -- [V6] the unknown-ports stamp of an address pair: the folded addresses' XOR xor their sum rotated left by 13
  -- (either order), its bytes XORed
  function u6_index(src, dst : w32) return unsigned is
    variable x, s : w32;
  begin
    s := std_logic_vector(unsigned(src) + unsigned(dst));
    x := src xor dst xor (s(18 downto 0) & s(31 downto 19));
    return unsigned(x(7 downto 0) xor x(15 downto 8) xor x(23 downto 16) xor x(31 downto 24));
  end function;

  function key_fwd(src, dst : w32; sp, dp : std_logic_vector(15 downto 0); proto : std_logic_vector(7 downto 0))
    return key_t is
  begin
    return src & dst & sp & dp & proto;
  end function;

  function swapped(src, dst : w32; sp, dp : std_logic_vector(15 downto 0)) return std_logic is
    variable a, b : std_logic_vector(47 downto 0);
  begin
    a := src & sp;
    b := dst & dp;
    return to_sl(unsigned(a) > unsigned(b));
  end function;

  function indices(a, c : w32) return idx_arr is
    variable r : idx_arr;
  begin
    r(0) := unsigned(a(LOG2 - 1 downto 0));
    r(1) := unsigned(c(LOG2 - 1 downto 0));
    r(2) := unsigned(a(31 downto 32 - LOG2));
    r(3) := unsigned(c(31 downto 32 - LOG2));
    return r;
  end function;

  signal now : unsigned(31 downto 0) := (others => '0');

  -- lookup pipeline: s1 the CRCs of both orders, s2 the memories' words, s3 the per-bank tests, then the result
  signal s1_lk, s1_eg, s1_swp : std_logic := '0';
  signal s1_af, s1_ar, s1_cf, s1_cr : w32 := (others => '0');
  signal l_a, l_c : w32;
  signal l_idx : idx_arr;
  signal l_eidx : unsigned(EW - 1 downto 0);
  signal s2_lk, s3_lk, s3_nz, s3_rec, s3_rdy : std_logic := '0';
  signal s1_v6, s1_ueg, s2_v6, s3_u6 : std_logic := '0';
  signal s1_uidx : unsigned(U6_LOG2 - 1 downto 0) := (others => '0');  -- [V6] the frame's unknown-ports stamp
  signal u_we : std_logic;
  signal u_addr : unsigned(U6_LOG2 - 1 downto 0);
  signal u_data, u_stamp : w32;
  signal o_v, o_m, o_e : std_logic := '0';
  signal e2_idx, e3_idx, o_idx : unsigned(EW - 1 downto 0) := (others => '0');
  -- shunt stamps (written by the decision, read by it)
  signal k_we, k_byp : std_logic := '0';
  signal k_addr : unsigned(EW - 1 downto 0);
  signal k_data, k_q : w32;
  signal l_cnt : cnt_arr;
  signal l_stamp : w32;

  -- host side
  type hstate_t is (SWEEP, IDLE, HASH, READ, MODIFY, WRITE);
  signal st : hstate_t := SWEEP;
  signal sw_idx : unsigned(SW_W - 1 downto 0) := (others => '0');
  signal sw_reset : std_logic := '1';  -- the sweep after reset: the stamps too
  signal c_op : std_logic_vector(1 downto 0) := (others => '0');
  signal c_key : key_t := (others => '0');
  signal c_v6 : std_logic := '0';
  signal c_idx : idx_arr := (others => (others => '0'));
  signal h_cnt : cnt_arr;
  signal w_we : std_logic := '0';
  signal w_cnt : cnt_arr := (others => (others => '0'));
  signal n_mem, n_sat, n_ref : unsigned(31 downto 0) := (others => '0');
  signal e_we : std_logic;
  signal e_addr : unsigned(EW - 1 downto 0);
  signal e_data : w32;
begin
  assert LOG2 >= 8 and LOG2 <= 24 report "hf_ct_member: LOG2 must be 8..24" severity failure;
  assert EW >= 4 and EW <= 24 report "hf_ct_member: EGRESS_LOG2 must be 4..24" severity failure;

  clock : process (clk)
  begin
    if rising_edge(clk) then
      now <= now + unsigned(ticks);
      if rst = '1' then
        now <= (others => '0');
      end if;
    end if;
  end process;

  stage1 : process (clk)
    variable ka, kb : key_t;
    variable src, dst : w32;
  begin
    if rising_edge(clk) then
      src := fold(lk_src_ip, lk_src_hi, lk_v6);
      dst := fold(lk_dst_ip, lk_dst_hi, lk_v6);
      ka := key_fwd(src, dst, lk_sport, lk_dport, lk_proto);
      kb := key_fwd(dst, src, lk_dport, lk_sport, lk_proto);
      s1_af <= crc(ka, COLS_A, base_a(lk_v6));
      s1_ar <= crc(kb, COLS_A, base_a(lk_v6));
      s1_cf <= crc(ka, COLS_C, base_c(lk_v6));
      s1_cr <= crc(kb, COLS_C, base_c(lk_v6));
      s1_swp <= swapped(src, dst, lk_sport, lk_dport);
      s1_lk <= lk_valid;
      s1_eg <= eg_valid;
      -- [V6] an IPv6 lookup reads, an IPv6 frame with unknown ports (eg_u6) writes, the stamp of its address pair (the
      -- addresses folded whatever lk_v6 says: such a frame's are IPv6 ones although the walk refused it)
      s1_v6 <= lk_v6 and to_sl(V6);
      s1_ueg <= eg_u6 and to_sl(V6);
      s1_uidx <= u6_index(fold(lk_src_ip, lk_src_hi, '1'), fold(lk_dst_ip, lk_dst_hi, '1'));
      if rst = '1' then
        s1_lk <= '0';
        s1_eg <= '0';
        s1_ueg <= '0';
      end if;
    end if;
  end process;

  l_a <= s1_ar when s1_swp = '1' else s1_af;
  l_c <= s1_cr when s1_swp = '1' else s1_cf;
  l_idx <= indices(l_a, l_c);
  l_eidx <= unsigned(l_a(8 + EW - 1 downto 8) xor l_c(8 + EW - 1 downto 8));

  banks : for b in 0 to NB - 1 generate
    signal we : std_logic;
    signal waddr : unsigned(LOG2 - 1 downto 0);
    signal wdata : std_logic_vector(CW - 1 downto 0);
    signal q : std_logic_vector(2 * CW - 1 downto 0);
  begin
    we <= '1' when st = SWEEP else w_we;
    waddr <= resize(sw_idx, LOG2) when st = SWEEP else c_idx(b);
    wdata <= (others => '0') when st = SWEEP else std_logic_vector(w_cnt(b));
    ram : entity work.hf_ram
      generic map (WIDTH => CW, ADDR_W => LOG2, READS => 2)
      port map (clk => clk, we => we, waddr => waddr, wdata => wdata,
                raddr => waddr & l_idx(b), rdata => q);
    l_cnt(b) <= unsigned(q(CW - 1 downto 0));
    h_cnt(b) <= unsigned(q(2 * CW - 1 downto CW));
  end generate;

  e_we <= '1' when st = SWEEP and sw_reset = '1' else s1_eg;
  e_addr <= resize(sw_idx, EW) when st = SWEEP and sw_reset = '1' else l_eidx;
  e_data <= (others => '0') when st = SWEEP and sw_reset = '1' else std_logic_vector(now);
  stamps : entity work.hf_ram
    generic map (WIDTH => 32, ADDR_W => EW, READS => 1)
    port map (clk => clk, we => e_we, waddr => e_addr, wdata => e_data, raddr => l_eidx, rdata => l_stamp);

  -- the shunt stamps: the decision's writes (and the reset sweep's), the decision's reads; a read of the word written in
  -- the same cycle gets the old word from the RAM, so the match of the two indices is kept beside it (k_byp)
  k_we <= '1' when st = SWEEP and sw_reset = '1' else sh_valid;
  k_addr <= resize(sw_idx, EW) when st = SWEEP and sw_reset = '1' else unsigned(sh_idx(EW - 1 downto 0));
  k_data <= (others => '0') when st = SWEEP and sw_reset = '1' else std_logic_vector(now);
  shunts : entity work.hf_ram
    generic map (WIDTH => 32, ADDR_W => EW, READS => 1)
    port map (clk => clk, we => k_we, waddr => k_addr, wdata => k_data, raddr => unsigned(ck_idx(EW - 1 downto 0)),
              rdata => k_q);
  bypass : process (clk)
  begin
    if rising_edge(clk) then
      k_byp <= sh_valid and to_sl(sh_idx(EW - 1 downto 0) = ck_idx(EW - 1 downto 0));
      if rst = '1' then
        k_byp <= '0';
      end if;
    end if;
  end process;
  ck_recent <= k_byp or to_sl(now - unsigned(k_q) < resize(unsigned(window), 32));

  -- [V6] the unknown-ports stamps: a lookup's read and an eg_u6 frame's write at stage 1, as the egress stamps
  u_we <= '1' when st = SWEEP and sw_reset = '1' else s1_ueg;
  u_addr <= resize(sw_idx, U6_LOG2) when st = SWEEP and sw_reset = '1' else s1_uidx;
  u_data <= (others => '0') when st = SWEEP and sw_reset = '1' else std_logic_vector(now);
  unknown6 : if V6 generate
    stamps6 : entity work.hf_ram
      generic map (WIDTH => 32, ADDR_W => U6_LOG2, READS => 1)
      port map (clk => clk, we => u_we, waddr => u_addr, wdata => u_data, raddr => s1_uidx, rdata => u_stamp);
  end generate;
  no_unknown6 : if not V6 generate
    u_stamp <= (others => '0');
  end generate;

  lookup : process (clk)
    variable nz : std_logic;
  begin
    if rising_edge(clk) then
      s2_lk <= s1_lk;
      s3_lk <= s2_lk;
      e2_idx <= l_eidx;
      e3_idx <= e2_idx;
      o_idx <= e3_idx;
      nz := '1';
      for b in 0 to NB - 1 loop
        if l_cnt(b) = 0 then
          nz := '0';
        end if;
      end loop;
      s3_nz <= nz;
      s3_rec <= to_sl(now - unsigned(l_stamp) < resize(unsigned(window), 32));
      s3_rdy <= to_sl(st /= SWEEP);
      s2_v6 <= s1_v6;
      s3_u6 <= s2_v6 and to_sl(now - unsigned(u_stamp) < resize(unsigned(window), 32));
      o_v <= s3_lk;
      o_m <= s3_nz or s3_rec or not s3_rdy or (s3_u6 and to_sl(V6));
      o_e <= s3_rec or (s3_u6 and to_sl(V6));
      if rst = '1' then
        s2_lk <= '0';
        s3_lk <= '0';
        o_v <= '0';
      end if;
    end if;
  end process;
  res_valid <= o_v;
  res_member <= o_m;
  res_egress <= o_e;
  res_eidx <= std_logic_vector(resize(o_idx, 24));

  host : process (clk)
    variable ka : key_t;
    variable a, c : w32;
    variable any0 : boolean;
    variable sat : unsigned(31 downto 0);
  begin
    if rising_edge(clk) then
      w_we <= '0';
      case st is
        when SWEEP =>
          if sw_idx = to_unsigned(2 ** SW_W - 1, SW_W) or (sw_reset = '0' and sw_idx = to_unsigned(2 ** LOG2 - 1, SW_W)) then
            sw_reset <= '0';
            st <= IDLE;
          end if;
          sw_idx <= sw_idx + 1;
        when IDLE =>
          if h_valid = '1' then
            c_op <= h_op;
            c_v6 <= h_v6 and to_sl(V6);
            if swapped(h_src_ip, h_dst_ip, h_sport, h_dport) = '1' then
              c_key <= key_fwd(h_dst_ip, h_src_ip, h_dport, h_sport, h_proto);
            else
              c_key <= key_fwd(h_src_ip, h_dst_ip, h_sport, h_dport, h_proto);
            end if;
            if h_op = "11" then
              sw_idx <= (others => '0');
              n_mem <= (others => '0');
              st <= SWEEP;
            elsif h_op = "01" or h_op = "10" then
              st <= HASH;
            end if;
          end if;
        when HASH =>
          c_idx <= indices(crc(c_key, COLS_A, base_a(c_v6)), crc(c_key, COLS_C, base_c(c_v6)));
          st <= READ;
        when READ =>
          st <= MODIFY;  -- the counters are read at the end of this cycle
        when MODIFY =>
          any0 := false;
          sat := (others => '0');
          for b in 0 to NB - 1 loop
            if h_cnt(b) = 0 then
              any0 := true;
            end if;
            w_cnt(b) <= h_cnt(b);
            if c_op = "01" and h_cnt(b) /= CMAX then
              w_cnt(b) <= h_cnt(b) + 1;
              if h_cnt(b) = CMAX - 1 then
                sat := sat + 1;
              end if;
            elsif c_op = "10" and h_cnt(b) /= CMAX and h_cnt(b) /= 0 then
              w_cnt(b) <= h_cnt(b) - 1;
            end if;
          end loop;
          if c_op = "01" then
            w_we <= '1';
            n_mem <= n_mem + 1;
            n_sat <= n_sat + sat;
          elsif any0 then
            n_ref <= n_ref + 1;  -- a delete of a key never inserted: nothing changes
          else
            w_we <= '1';
            n_mem <= n_mem - 1;
          end if;
          st <= WRITE;
        when WRITE =>
          st <= IDLE;  -- the counters are written at the end of this cycle
      end case;
      if rst = '1' then
        st <= SWEEP;
        sw_idx <= (others => '0');
        sw_reset <= '1';
        w_we <= '0';
        n_mem <= (others => '0');
        n_sat <= (others => '0');
        n_ref <= (others => '0');
      end if;
    end if;
  end process;

  h_ready <= '1' when st = IDLE and rst = '0' else '0';
  members <= std_logic_vector(n_mem);
  saturated <= std_logic_vector(n_sat);
  refused <= std_logic_vector(n_ref);
  ready <= '0' when st = SWEEP else '1';
end architecture;

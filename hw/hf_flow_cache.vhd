-- The flow cache: a set-associative table of flows (both directions under one canonical key) looked up at one
-- header per cycle, with a last-seen time and a hit counter per entry and a command port for the host.
--
-- Layouts, hash and command codes are those of mgmt/hypafilter/hw/flowcache.py (the Python reference):
--   canonical key (104 bits): lo_ip(103:72) hi_ip(71:40) lo_port(39:24) hi_port(23:8) proto(7:0), where the
--     (ip, port) endpoint compared as the 48-bit number ip & port that is not greater is "lo";
--   key word (107 bits): valid(106) epoch(105) orient(104) key(103:0); orient = 1 when the flow's original
--     direction has its source as the "hi" endpoint;
--   stats word (35 + TS_W bits): epoch, closing (2), last-seen time (TS_W), hits (32); a stats word counts for
--     the entry only when its epoch equals the key word's (an insert picks the epoch the slot's stats word does
--     not have, so the host never writes statistics and the hit path keeps both ports of their memories);
--   closing: the TCP FINs the entry has passed (a FIN adds 1, an RST sets 2; 2 stays). Conntrack takes a flow to
--     LAST_ACK at its second FIN (either direction) and to CLOSE at an RST; from then on its ACKs must reach
--     conntrack, so an entry at 2 no longer hits. The FIN/RST frames themselves still bypass (to software); the
--     hit path counts them in the same cycle, so no frame behind them hits before the host could delete the
--     entry. Counting FINs conntrack would refuse (out of window, no ACK) only ends hits early: more frames to
--     software, never a wrong hit;
--   set = the low LOG2_SETS bits of zlib's CRC-32 of the key's 13 bytes (most significant first);
--   with IPv6 tuples (generic V6, a dual-stack core): the key is 304 bits, family(303:296, 1 for IPv6, 0 for IPv4)
--     lo_ip(295:168) hi_ip(167:40) lo_port(39:24) hi_port(23:8) proto(7:0), an IPv4 address zero-extended to 128
--     bits (the family byte keeps it apart from the IPv6 address ::a.b.c.d), endpoints compared as the 144-bit
--     numbers ip & port, the set from the CRC-32 of the key's 38 bytes; the key word is 307 bits (valid(306)
--     epoch(305) orient(304) key). Exact: a hit is the flow's own full tuple, never another's that hashes alike.
--     An address arrives as its low 32 bits (*_src_ip, *_dst_ip) and its upper 96 (*_src_hi, *_dst_hi, read only
--     with *_v6 = '1'). Without V6 (an IPv4-only core) nothing of this is built: a command with h_v6 = '1'
--     answers status 4 (bad command) and a lookup with lk_v6 = '1' is a bypass;
--   slot = way * 2**LOG2_SETS + set.
-- Memories per way: key words (read by lookups; read and written by host commands: a true dual-port RAM), stats
-- (read and written by the hit path), and a copy of the stats written with them and read by host commands. The
-- sweep after reset (and at power-on) invalidates every key word and zeroes every stats word; a clear command's
-- sweep invalidates the key words only (in-flight hits may still write stats then).
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_flow_cache is
  generic (
    LOG2_SETS   : natural  := 10;      -- sets = 2**LOG2_SETS, indexed by the low bits of the key's CRC-32
    WAYS        : positive := 4;       -- entries per set (one RAM bank each); WAYS * 2**LOG2_SETS in 4,096..65,536
    TS_W        : positive := 32;      -- width of the last-seen timestamp, in ticks (it wraps)
    TICK_CYCLES : positive := 200000;  -- clock cycles per timestamp tick (1 ms at 200 MHz)
    V6          : boolean  := false    -- IPv6 tuples too (304-bit keys, header comment); false: IPv4 keys only
  );
  port (
    clk          : in  std_logic;
    rst          : in  std_logic;  -- synchronous: empties the cache (a sweep of 2**LOG2_SETS cycles), zeroes counters
    -- lookup: one header per cycle, never stalled; the result follows exactly LATENCY = 4 cycles later
    lk_valid     : in  std_logic;
    lk_src_ip    : in  std_logic_vector(31 downto 0);
    lk_dst_ip    : in  std_logic_vector(31 downto 0);
    lk_proto     : in  std_logic_vector(7 downto 0);
    lk_sport     : in  std_logic_vector(15 downto 0);
    lk_dport     : in  std_logic_vector(15 downto 0);
    lk_v6        : in  std_logic := '0';  -- an IPv6 tuple: lk_*_hi are the addresses' bits 127:32 (V6 only)
    lk_src_hi    : in  std_logic_vector(95 downto 0) := (others => '0');
    lk_dst_hi    : in  std_logic_vector(95 downto 0) := (others => '0');
    lk_tcp_flags : in  std_logic_vector(7 downto 0);  -- FIN 0x01, SYN 0x02, RST 0x04, ACK 0x10 (read when proto = 6)
    lk_l4_ok     : in  std_logic := '1';  -- '0': TCP data offset or UDP length field that conntrack calls INVALID
    res_valid    : out std_logic;
    res_hit      : out std_logic;  -- the flow is in the cache (never for a bypass frame)
    res_bypass   : out std_logic;  -- TCP with SYN, FIN or RST, or without ACK; lk_l4_ok = '0': a miss, not counted
                                   -- (a FIN or RST of a cached flow counts towards its closing, header comment)
    res_dir      : out std_logic;  -- of a hit: 0 original direction, 1 reply
    res_slot     : out std_logic_vector(clog2(WAYS) + LOG2_SETS - 1 downto 0);  -- of a hit
    -- host commands: h_* taken in a cycle with h_valid = h_ready = '1'; r_valid pulses when the command is done,
    -- and from then on every lookup result reflects it; r_* hold until the next command is done
    h_valid      : in  std_logic;
    h_ready      : out std_logic;
    h_op         : in  std_logic_vector(2 downto 0);  -- 1 insert, 2 delete, 3 delete slot, 4 read slot, 5 find, 6 clear
    h_src_ip     : in  std_logic_vector(31 downto 0);  -- key ops: the flow in its original direction
    h_dst_ip     : in  std_logic_vector(31 downto 0);
    h_proto      : in  std_logic_vector(7 downto 0);
    h_sport      : in  std_logic_vector(15 downto 0);
    h_dport      : in  std_logic_vector(15 downto 0);
    h_v6         : in  std_logic := '0';  -- key ops: an IPv6 flow, h_*_hi its addresses' bits 127:32 (V6 only)
    h_src_hi     : in  std_logic_vector(95 downto 0) := (others => '0');
    h_dst_hi     : in  std_logic_vector(95 downto 0) := (others => '0');
    h_slot       : in  std_logic_vector(23 downto 0);  -- slot ops
    r_valid      : out std_logic;
    r_status     : out std_logic_vector(3 downto 0);  -- 0 ok, 1 exists, 2 full, 3 not found, 4 bad command or slot
    r_slot       : out std_logic_vector(23 downto 0);
    r_word       : out std_logic_vector(fc_key_w(V6) + 2 downto 0);  -- key word of the slot (read, find, insert
                                                                      -- that exists)
    r_counted    : out std_logic;  -- the entry was hit since its insert (r_seen, r_hits are 0 otherwise)
    r_seen       : out std_logic_vector(TS_W - 1 downto 0);
    r_hits       : out std_logic_vector(31 downto 0);
    now          : out std_logic_vector(TS_W - 1 downto 0);  -- the timestamp a lookup taken now would record
    occupancy    : out std_logic_vector(31 downto 0);  -- valid entries
    cnt_inserts  : out std_logic_vector(31 downto 0);  -- successful inserts
    cnt_deletes  : out std_logic_vector(31 downto 0);  -- entries deleted by command (clear not counted)
    cnt_full     : out std_logic_vector(31 downto 0);  -- inserts refused because every way of the set was valid
    cnt_clear    : in  std_logic;  -- zero cnt_inserts, cnt_deletes, cnt_full (the core's RESET bit 0)
    ready        : out std_logic  -- '0' during a sweep (reset, clear): every lookup misses
  );
end entity;

architecture rtl of hf_flow_cache is
  constant KEY_W : natural := fc_key_w(V6);  -- 104, or 304 with IPv6 tuples
  constant WORD_W : natural := KEY_W + 3;
  constant V_BIT : natural := KEY_W + 2;
  constant E_BIT : natural := KEY_W + 1;
  constant O_BIT : natural := KEY_W;
  constant AW : natural := (KEY_W - 40) / 2 - 4 * boolean'pos(V6);  -- address bits in the key: 32, or 128
  constant ST_W : natural := 35 + TS_W;
  constant SE_BIT : natural := ST_W - 1;
  constant CL_HI : natural := ST_W - 2;  -- closing count (2 bits)
  constant CL_LO : natural := ST_W - 3;
  constant SETS : natural := 2 ** LOG2_SETS;
  constant ENTRIES : natural := WAYS * SETS;
  constant SLOT_W : natural := clog2(WAYS) + LOG2_SETS;
  constant SETTLE : natural := 4;  -- cycles after a key write until no result of an earlier read is left

  constant OP_INSERT : std_logic_vector(2 downto 0) := "001";
  constant OP_DELETE : std_logic_vector(2 downto 0) := "010";
  constant OP_DELETE_SLOT : std_logic_vector(2 downto 0) := "011";
  constant OP_READ : std_logic_vector(2 downto 0) := "100";
  constant OP_FIND : std_logic_vector(2 downto 0) := "101";
  constant OP_CLEAR : std_logic_vector(2 downto 0) := "110";
  constant ST_OK : std_logic_vector(3 downto 0) := x"0";
  constant ST_EXISTS : std_logic_vector(3 downto 0) := x"1";
  constant ST_FULL : std_logic_vector(3 downto 0) := x"2";
  constant ST_NOT_FOUND : std_logic_vector(3 downto 0) := x"3";
  constant ST_BAD : std_logic_vector(3 downto 0) := x"4";

  subtype key_t is std_logic_vector(KEY_W - 1 downto 0);
  subtype addr_t is std_logic_vector(AW - 1 downto 0);
  subtype set_t is unsigned(LOG2_SETS - 1 downto 0);
  type word_arr is array (0 to WAYS - 1) of std_logic_vector(WORD_W - 1 downto 0);
  type stat_arr is array (0 to WAYS - 1) of std_logic_vector(ST_W - 1 downto 0);

  -- zlib's CRC-32 (reflected polynomial 0xEDB88320, initial value and final xor all ones) of the key's bytes,
  -- most significant byte first: a linear XOR network (each set bit depends on about half the key bits, three
  -- LUT levels), good spread for structured keys, and zlib.crc32 in Python is the reference.
  function key_crc(k : key_t) return std_logic_vector is
    variable c : std_logic_vector(31 downto 0) := (others => '1');
  begin
    for i in KEY_W / 8 - 1 downto 0 loop
      c(7 downto 0) := c(7 downto 0) xor k(8 * i + 7 downto 8 * i);
      for b in 0 to 7 loop
        c := ('0' & c(31 downto 1)) xor (x"EDB88320" and (31 downto 0 => c(0)));
      end loop;
    end loop;
    return not c;
  end function;

  -- The CRC is affine in the key: bit j = CRC_ZERO(j) xor the key bits i whose column CRC_COLS(i) has bit j set.
  -- Written as such, an XOR reduction, it maps to three LUT levels; the loop above, synthesised as it stands, is a
  -- 104-step chain that yosys left 11 levels deep.
  type crc_cols_t is array (0 to KEY_W - 1) of std_logic_vector(31 downto 0);
  function crc_columns return crc_cols_t is
    variable r : crc_cols_t;
    variable e : key_t;
  begin
    for i in 0 to KEY_W - 1 loop
      e := (others => '0');
      e(i) := '1';
      r(i) := key_crc(e) xor key_crc((others => '0'));
    end loop;
    return r;
  end function;
  constant CRC_COLS : crc_cols_t := crc_columns;
  constant CRC_ZERO : std_logic_vector(31 downto 0) := key_crc((others => '0'));

  function key_set(k : key_t) return set_t is
    variable r : set_t;
    variable m : key_t;
  begin
    for j in 0 to LOG2_SETS - 1 loop
      for i in 0 to KEY_W - 1 loop
        m(i) := CRC_COLS(i)(j);
      end loop;
      r(j) := (xor (k and m)) xor CRC_ZERO(j);  -- a reduction: yosys builds it as a balanced tree
    end loop;
    return r;
  end function;

  -- an address as the key holds it: its 32 bits, or with IPv6 tuples 128 (an IPv4 one zero-extended)
  function addr_of(fam : std_logic; hi : std_logic_vector(95 downto 0); lo : std_logic_vector(31 downto 0))
    return addr_t is
    variable a : addr_t;
  begin
    a(31 downto 0) := lo;
    if V6 then
      a(AW - 1 downto 32) := hi and (95 downto 0 => fam);
    end if;
    return a;
  end function;

  -- the key with the source as "lo" endpoint (keyed), and with the destination as "lo" (keyed the other way)
  function key_fwd(fam : std_logic; src, dst : addr_t; sp, dp : std_logic_vector(15 downto 0);
                   proto : std_logic_vector(7 downto 0)) return key_t is
    variable k : key_t;
  begin
    k(2 * AW + 39 downto AW + 40) := src;
    k(AW + 39 downto 40) := dst;
    k(39 downto 24) := sp;
    k(23 downto 8) := dp;
    k(7 downto 0) := proto;
    if V6 then
      k(KEY_W - 1 downto KEY_W - 8) := "0000000" & fam;
    end if;
    return k;
  end function;

  function swapped(src, dst : addr_t; sp, dp : std_logic_vector(15 downto 0)) return std_logic is
    variable a, b : std_logic_vector(AW + 15 downto 0);
  begin
    a := src & sp;
    b := dst & dp;
    return to_sl(unsigned(a) > unsigned(b));
  end function;

  function slot_of(way : natural; set : set_t) return unsigned is
  begin
    return to_unsigned(way * SETS + to_integer(set), SLOT_W);
  end function;

  -- timestamp
  signal tick : natural range 0 to TICK_CYCLES - 1 := 0;
  signal ts : unsigned(TS_W - 1 downto 0) := (others => '0');

  -- lookup pipeline: s1 keys and both hashes, s2 key words (and the stats read), s3 per-way match and stats,
  -- s4 the result
  signal s1_v, s1_byp, s1_swp, s1_fin, s1_rst : std_logic := '0';
  signal s1_key : key_t := (others => '0');
  signal s1_ha, s1_hb : set_t := (others => '0');
  signal s1_ts : unsigned(TS_W - 1 downto 0) := (others => '0');
  signal rd_set : set_t;
  signal s2_v, s2_byp, s2_swp, s2_ok, s2_fin, s2_rst : std_logic := '0';
  signal s2_key : key_t := (others => '0');
  signal s2_set : set_t := (others => '0');
  signal s2_ts : unsigned(TS_W - 1 downto 0) := (others => '0');
  signal lk_word : word_arr;
  signal s3_v, s3_byp, s3_swp, s3_f1, s3_fin, s3_rst : std_logic := '0';
  signal s3_match, s3_orient, s3_kep : std_logic_vector(WAYS - 1 downto 0) := (others => '0');
  signal s3_cmatch : std_logic_vector(WAYS - 1 downto 0) := (others => '0');  -- a FIN/RST frame of the entry
  signal s3_hit, s3_we : std_logic_vector(WAYS - 1 downto 0);  -- a hit (match, not closed); a stats write
  signal s3_set : set_t := (others => '0');
  signal s3_ts : unsigned(TS_W - 1 downto 0) := (others => '0');
  signal lk_stat : stat_arr;  -- the stats RAM output: read at s2_set, valid in s3
  signal st_new : stat_arr;
  signal w1_we : std_logic_vector(WAYS - 1 downto 0) := (others => '0');
  signal w1_val : stat_arr := (others => (others => '0'));
  signal o_v, o_hit, o_byp, o_dir : std_logic := '0';
  signal o_slot : unsigned(SLOT_W - 1 downto 0) := (others => '0');

  -- host side
  type hstate_t is (SWEEP, IDLE, HASH, READ, MATCH, DECIDE, WRITE, SETTLING, DONE);
  signal st : hstate_t := SWEEP;
  signal sw_idx : set_t := (others => '0');
  signal sw_clear : std_logic := '0';  -- the sweep runs for a clear command (answer when it ends)
  signal sw_zero : std_logic;  -- a reset sweep: the stats words are zeroed too
  signal c_op : std_logic_vector(2 downto 0) := (others => '0');
  signal c_key : key_t := (others => '0');
  signal c_swp : std_logic := '0';
  signal c_slot : unsigned(23 downto 0) := (others => '0');
  signal c_set : set_t := (others => '0');
  signal c_way : natural range 0 to WAYS - 1 := 0;
  signal c_slot_ok : std_logic := '0';
  signal c_wdata : std_logic_vector(WORD_W - 1 downto 0) := (others => '0');
  signal settle_n : natural range 0 to SETTLE := 0;
  signal hb_addr : set_t;
  signal hk_we : std_logic_vector(WAYS - 1 downto 0);
  signal hk_data : std_logic_vector(WORD_W - 1 downto 0);
  signal hk_any : std_logic;
  signal hb_word : word_arr;
  signal hm, hf : std_logic_vector(WAYS - 1 downto 0) := (others => '0');  -- per way: key matches, free
  signal hb_stat : stat_arr;
  signal rv : std_logic := '0';
  signal r_st : std_logic_vector(3 downto 0) := (others => '0');
  signal r_sl : unsigned(23 downto 0) := (others => '0');
  signal r_w : std_logic_vector(WORD_W - 1 downto 0) := (others => '0');
  signal r_cnt : std_logic := '0';
  signal r_sn : std_logic_vector(TS_W - 1 downto 0) := (others => '0');
  signal r_h : std_logic_vector(31 downto 0) := (others => '0');
  signal n_occ, n_ins, n_del, n_full : unsigned(31 downto 0) := (others => '0');
begin
  assert ENTRIES >= 4096 and ENTRIES <= 65536
    report "hf_flow_cache: WAYS * 2**LOG2_SETS must be 4,096..65,536 entries" severity failure;
  assert WAYS <= 16 report "hf_flow_cache: at most 16 ways" severity failure;
  assert TS_W <= 32 report "hf_flow_cache: TS_W at most 32 (one register word)" severity failure;

  timestamp : process (clk)
  begin
    if rising_edge(clk) then
      if tick = TICK_CYCLES - 1 then
        tick <= 0;
        ts <= ts + 1;
      else
        tick <= tick + 1;
      end if;
      if rst = '1' then
        tick <= 0;
        ts <= (others => '0');
      end if;
    end if;
  end process;
  now <= std_logic_vector(ts);

  -- s1: canonical key, direction, bypass; the set from the two hashes of both orders (no compare before a hash)
  stage1 : process (clk)
    variable ka, kb : key_t;
    variable sa, da : addr_t;
    variable sw : std_logic;
  begin
    if rising_edge(clk) then
      sa := addr_of(lk_v6, lk_src_hi, lk_src_ip);
      da := addr_of(lk_v6, lk_dst_hi, lk_dst_ip);
      ka := key_fwd(lk_v6, sa, da, lk_sport, lk_dport, lk_proto);
      kb := key_fwd(lk_v6, da, sa, lk_dport, lk_sport, lk_proto);
      sw := swapped(sa, da, lk_sport, lk_dport);
      s1_v <= lk_valid;
      s1_byp <= to_sl(lk_proto = x"06"
                      and (lk_tcp_flags(0) or lk_tcp_flags(1) or lk_tcp_flags(2) or not lk_tcp_flags(4)) = '1')
                or not lk_l4_ok or (lk_v6 and to_sl(not V6));
      s1_swp <= sw;
      s1_fin <= to_sl(lk_proto = x"06") and lk_tcp_flags(0);
      s1_rst <= to_sl(lk_proto = x"06") and lk_tcp_flags(2);
      s1_key <= kb when sw = '1' else ka;
      s1_ha <= key_set(ka);
      s1_hb <= key_set(kb);
      s1_ts <= ts;
      if rst = '1' then
        s1_v <= '0';
      end if;
    end if;
  end process;
  rd_set <= s1_hb when s1_swp = '1' else s1_ha;

  -- s2: the key words of the set arrive; a lookup whose read met a host write to its set, or a sweep, misses
  stage2 : process (clk)
  begin
    if rising_edge(clk) then
      s2_v <= s1_v;
      s2_byp <= s1_byp;
      s2_swp <= s1_swp;
      s2_fin <= s1_fin;
      s2_rst <= s1_rst;
      s2_key <= s1_key;
      s2_set <= rd_set;
      s2_ts <= s1_ts;
      s2_ok <= to_sl(st /= SWEEP) and not (hk_any and to_sl(hb_addr = rd_set));
      if rst = '1' then
        s2_v <= '0';
      end if;
    end if;
  end process;

  -- s3: one match bit per way (at most one: inserts refuse a key that is present)
  stage3 : process (clk)
    variable m : std_logic;
  begin
    if rising_edge(clk) then
      for w in 0 to WAYS - 1 loop
        m := s2_v and s2_ok and lk_word(w)(V_BIT) and to_sl(lk_word(w)(KEY_W - 1 downto 0) = s2_key);
        s3_match(w) <= m and not s2_byp;
        s3_cmatch(w) <= m and (s2_fin or s2_rst);
        s3_orient(w) <= lk_word(w)(O_BIT);
        s3_kep(w) <= lk_word(w)(E_BIT);
      end loop;
      s3_v <= s2_v;
      s3_byp <= s2_byp;
      s3_swp <= s2_swp;
      s3_fin <= s2_fin;
      s3_rst <= s2_rst;
      s3_set <= s2_set;
      s3_ts <= s2_ts;
      -- the stats write issued while this lookup's read ran (by the lookup one ahead, now in s3) is forwarded
      s3_f1 <= to_sl(s2_set = s3_set);
      if rst = '1' then
        s3_v <= '0';
        s3_match <= (others => '0');
        s3_cmatch <= (others => '0');
      end if;
    end if;
  end process;

  -- s3 stats update per way: read-modify-write, the previous cycle's write forwarded; a stats word of another
  -- epoch belongs to an earlier entry of the slot and starts over (hits 1 for a hit, 0 for a FIN/RST, closing 0
  -- before this frame). A match of a closed entry (closing 2) is no hit and writes nothing; a FIN or RST of the
  -- entry writes its closing count and keeps last-seen and hits.
  stats_update : for w in 0 to WAYS - 1 generate
    process (all)
      variable cur : std_logic_vector(ST_W - 1 downto 0);
      variable h : unsigned(31 downto 0);
      variable t : std_logic_vector(TS_W - 1 downto 0);
      variable cl : unsigned(1 downto 0);
      variable same : boolean;
    begin
      if s3_f1 = '1' and w1_we(w) = '1' then
        cur := w1_val(w);
      else
        cur := lk_stat(w);
      end if;
      same := cur(SE_BIT) = s3_kep(w);
      h := (others => '0');
      t := (others => '0');
      cl := "00";
      if same then
        h := unsigned(cur(31 downto 0));
        t := cur(TS_W + 31 downto 32);
        cl := unsigned(cur(CL_HI downto CL_LO));
      end if;
      s3_hit(w) <= s3_match(w) and not cl(1);
      if s3_cmatch(w) = '1' then
        if s3_rst = '1' or cl /= "00" then
          cl := "10";
        else
          cl := "01";
        end if;
      else
        h := h + 1;
        t := std_logic_vector(s3_ts);
      end if;
      st_new(w) <= s3_kep(w) & std_logic_vector(cl) & t & std_logic_vector(h);
    end process;
    s3_we(w) <= s3_hit(w) or s3_cmatch(w);
  end generate;

  history : process (clk)
  begin
    if rising_edge(clk) then
      w1_we <= s3_we;
      w1_val <= st_new;
      if rst = '1' then
        w1_we <= (others => '0');
      end if;
    end if;
  end process;

  -- s4: the result
  result : process (clk)
    variable hit, dir : std_logic;
    variable way : natural range 0 to WAYS - 1;
  begin
    if rising_edge(clk) then
      hit := '0';
      dir := '0';
      way := 0;
      for w in 0 to WAYS - 1 loop
        if s3_hit(w) = '1' then
          hit := '1';
          dir := s3_orient(w) xor s3_swp;
          way := w;
        end if;
      end loop;
      o_v <= s3_v;
      o_hit <= hit;
      o_byp <= s3_v and s3_byp;
      o_dir <= dir;
      o_slot <= slot_of(way, s3_set);
      if rst = '1' then
        o_v <= '0';
        o_hit <= '0';
      end if;
    end if;
  end process;
  res_valid <= o_v;
  res_hit <= o_hit;
  res_bypass <= o_byp;
  res_dir <= o_dir;
  res_slot <= std_logic_vector(o_slot);

  -- the memories of each way
  hb_addr <= sw_idx when st = SWEEP else c_set;
  hk_data <= (others => '0') when st = SWEEP else c_wdata;
  hk_any <= '1' when st = SWEEP or st = WRITE else '0';
  sw_zero <= '1' when st = SWEEP and sw_clear = '0' else '0';

  -- no initial values in the memories (hf_ram): the power-on sweep writes every word
  banks : for w in 0 to WAYS - 1 generate
    signal s_we : std_logic;
    signal s_addr : set_t;
    signal s_data : std_logic_vector(ST_W - 1 downto 0);
    signal k_rd : std_logic_vector(2 * WORD_W - 1 downto 0);  -- both read ports (the word width is not locally
                                                              -- static: a port map cannot slice it)
  begin
    hk_we(w) <= '1' when st = SWEEP or (st = WRITE and c_way = w) else '0';

    key_ram : entity work.hf_ram
      generic map (WIDTH => WORD_W, ADDR_W => LOG2_SETS, READS => 2)
      port map (clk => clk, we => hk_we(w), waddr => hb_addr, wdata => hk_data, raddr => rd_set & hb_addr,
                rdata => k_rd);
    lk_word(w) <= k_rd(2 * WORD_W - 1 downto WORD_W);
    hb_word(w) <= k_rd(WORD_W - 1 downto 0);

    -- the hit path owns the stats write port, except in a reset sweep, when no lookup can hit, which zeroes them
    s_we <= s3_we(w) or sw_zero;
    s_addr <= sw_idx when sw_zero = '1' else s3_set;
    s_data <= (others => '0') when sw_zero = '1' else st_new(w);

    -- two memories with the same contents: smem is read by the hit path, scopy by the host, so each keeps one
    -- write port and one read port (a simple dual-port block RAM)
    smem : entity work.hf_ram
      generic map (WIDTH => ST_W, ADDR_W => LOG2_SETS)
      port map (clk => clk, we => s_we, waddr => s_addr, wdata => s_data, raddr => s2_set, rdata => lk_stat(w));
    scopy : entity work.hf_ram
      generic map (WIDTH => ST_W, ADDR_W => LOG2_SETS)
      port map (clk => clk, we => s_we, waddr => s_addr, wdata => s_data, raddr => hb_addr, rdata => hb_stat(w));
  end generate;

  host : process (clk)
    variable sa, da : addr_t;
    variable match_any, free_any, valid, counted : boolean;
    variable mw, fw, sel : natural range 0 to WAYS - 1;
    variable word : std_logic_vector(WORD_W - 1 downto 0);
    variable stat : std_logic_vector(ST_W - 1 downto 0);
  begin
    if rising_edge(clk) then
      rv <= '0';
      case st is
        when SWEEP =>
          sw_idx <= sw_idx + 1;
          if sw_idx = SETS - 1 then
            if sw_clear = '1' then
              r_st <= ST_OK;
              r_sl <= (others => '0');
              r_w <= (others => '0');
              r_cnt <= '0';
              r_sn <= (others => '0');
              r_h <= (others => '0');
              settle_n <= 0;
              st <= SETTLING;
            else
              st <= IDLE;
            end if;
            sw_clear <= '0';
          end if;
        when IDLE =>
          if h_valid = '1' then
            sa := addr_of(h_v6, h_src_hi, h_src_ip);
            da := addr_of(h_v6, h_dst_hi, h_dst_ip);
            c_op <= h_op;
            if h_v6 = '1' and not V6 then
              c_op <= "111";  -- an IPv6 key in an IPv4-only cache: a bad command
            end if;
            c_swp <= swapped(sa, da, h_sport, h_dport);
            if swapped(sa, da, h_sport, h_dport) = '1' then
              c_key <= key_fwd(h_v6, da, sa, h_dport, h_sport, h_proto);
            else
              c_key <= key_fwd(h_v6, sa, da, h_sport, h_dport, h_proto);
            end if;
            c_slot <= unsigned(h_slot);
            st <= HASH;
          end if;
        when HASH =>
          if c_op = OP_DELETE_SLOT or c_op = OP_READ then
            c_set <= c_slot(LOG2_SETS - 1 downto 0);
            c_way <= to_integer(resize(shift_right(c_slot, LOG2_SETS), 5)) mod WAYS;
            c_slot_ok <= to_sl(c_slot < ENTRIES);
          else
            c_set <= key_set(c_key);
            c_slot_ok <= '1';
          end if;
          if c_op = OP_CLEAR then
            sw_idx <= (others => '0');
            sw_clear <= '1';
            n_occ <= (others => '0');
            st <= SWEEP;
          else
            st <= READ;
          end if;
        when READ =>
          st <= MATCH;  -- the set's words are read at the end of this cycle
        when MATCH =>
          for w in 0 to WAYS - 1 loop
            hm(w) <= hb_word(w)(V_BIT) and to_sl(hb_word(w)(KEY_W - 1 downto 0) = c_key);
            hf(w) <= not hb_word(w)(V_BIT);
          end loop;
          st <= DECIDE;
        when DECIDE =>
          match_any := false;
          free_any := false;
          mw := 0;
          fw := 0;
          for w in WAYS - 1 downto 0 loop  -- the lowest free way wins
            if hm(w) = '1' then
              match_any := true;
              mw := w;
            end if;
            if hf(w) = '1' then
              free_any := true;
              fw := w;
            end if;
          end loop;
          if c_op = OP_DELETE_SLOT or c_op = OP_READ then
            sel := c_way;
          elsif match_any then
            sel := mw;
          else
            sel := fw;
          end if;
          word := hb_word(sel);
          stat := hb_stat(sel);
          valid := word(V_BIT) = '1';
          counted := valid and stat(SE_BIT) = word(E_BIT);
          r_sl <= resize(slot_of(sel, c_set), 24);
          r_w <= word;
          r_cnt <= to_sl(counted);
          r_sn <= (others => '0');
          r_h <= (others => '0');
          if counted then
            r_sn <= stat(TS_W + 31 downto 32);
            r_h <= stat(31 downto 0);
          end if;
          c_way <= sel;
          st <= DONE;
          if c_op = OP_INSERT then
            if match_any then
              r_st <= ST_EXISTS;
            elsif free_any then
              r_st <= ST_OK;
              r_cnt <= '0';
              r_sn <= (others => '0');
              r_h <= (others => '0');
              -- the epoch the slot's stats word does not have: the entry starts uncounted
              r_w <= '1' & not stat(SE_BIT) & c_swp & c_key;
              c_wdata <= '1' & not stat(SE_BIT) & c_swp & c_key;
              n_occ <= n_occ + 1;
              n_ins <= n_ins + 1;
              st <= WRITE;
            else
              r_st <= ST_FULL;
              r_sl <= (others => '0');
              r_w <= (others => '0');
              n_full <= n_full + 1;
            end if;
          elsif c_op = OP_DELETE or c_op = OP_FIND then
            if not match_any then
              r_st <= ST_NOT_FOUND;
              r_sl <= (others => '0');
              r_w <= (others => '0');
            else
              r_st <= ST_OK;
              if c_op = OP_DELETE then
                c_wdata <= (others => '0');
                n_occ <= n_occ - 1;
                n_del <= n_del + 1;
                st <= WRITE;
              end if;
            end if;
          elsif c_op = OP_DELETE_SLOT or c_op = OP_READ then
            if c_slot_ok = '0' then
              r_st <= ST_BAD;
              r_sl <= c_slot;
              r_w <= (others => '0');
              r_cnt <= '0';
              r_sn <= (others => '0');
              r_h <= (others => '0');
            elsif c_op = OP_READ then
              r_st <= ST_OK;
            elsif valid then
              r_st <= ST_OK;
              c_wdata <= (others => '0');
              n_occ <= n_occ - 1;
              n_del <= n_del + 1;
              st <= WRITE;
            else
              r_st <= ST_NOT_FOUND;
            end if;
          else
            r_st <= ST_BAD;
            r_sl <= (others => '0');
            r_w <= (others => '0');
            r_cnt <= '0';
            r_sn <= (others => '0');
            r_h <= (others => '0');
          end if;
        when WRITE =>
          settle_n <= 0;
          st <= SETTLING;
        when SETTLING =>
          if settle_n = SETTLE - 1 then
            st <= DONE;
          else
            settle_n <= settle_n + 1;
          end if;
        when DONE =>
          rv <= '1';
          st <= IDLE;
      end case;
      if cnt_clear = '1' then
        n_ins <= (others => '0');
        n_del <= (others => '0');
        n_full <= (others => '0');
      end if;
      if rst = '1' then
        st <= SWEEP;
        sw_idx <= (others => '0');
        sw_clear <= '0';
        rv <= '0';
        n_occ <= (others => '0');
        n_ins <= (others => '0');
        n_del <= (others => '0');
        n_full <= (others => '0');
      end if;
    end if;
  end process;

  h_ready <= '1' when st = IDLE and rst = '0' else '0';
  r_valid <= rv;
  r_status <= r_st;
  r_slot <= std_logic_vector(r_sl);
  r_word <= r_w;
  r_counted <= r_cnt;
  r_seen <= r_sn;
  r_hits <= r_h;
  occupancy <= std_logic_vector(n_occ);
  cnt_inserts <= std_logic_vector(n_ins);
  cnt_deletes <= std_logic_vector(n_del);
  cnt_full <= std_logic_vector(n_full);
  ready <= '0' when st = SWEEP else '1';
end architecture;

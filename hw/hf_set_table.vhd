-- One set slot's membership table (ARCHITECTURE.md section 9): from the parsed header it answers, LATENCY = 4 cycles
-- later and one header per cycle, whether the frame is a member of the slot's set (by the slot's directions) and
-- whether that answer rests on an uncertain element (near its timeout; the core then shunts the frame, reason 3).
-- The set is kept in BANKS hash banks. Each bank holds the elements of one prefix length (a run-time register,
-- table SET_BANK); every bank is probed in parallel with the frame's address masked to its length, and the longest
-- length that hits decides (longest-prefix match, as the kernel's hash:net walks its prefix lengths from the most
-- specific): a hit on a nomatch element there means "not a member". hash:ip and hash:ip,port use the same banks at
-- length 32 (or the set's netmask). A bank is 2**LOG2_BUCKETS buckets of WAYS elements, one memory per bank with a
-- bucket per word (one write port, a lookup and a host read port: block RAM); the host places every element itself,
-- with the bucket hash of hf_set_pkg, so an insert or a delete is one element write (hypafilter.hw.settable), which
-- the table applies as a read-modify-write of the bucket's word.
-- Tables (IND_ADDRESS = table << 24 | index, index bits 22:20 = slot, which the core decodes):
--   SET_ELEM (8)  index = slot << 20 | bank << 16 | (bucket * WAYS + way) << 1 | w; w0 address (masked to the bank's
--                 length), w1 valid << 31 | uncertain << 30 | nomatch << 29 | proto << 16 | port. A write of w1
--                 stores the element with the last w0 written, in one memory write of its bucket (a lookup sees the
--                 old or the new element, never a mix).
--   SET_BANK (9)  index = slot << 20 | bank: enable << 31 | prefix length (5:0). Disabled after reset.
--   SET_INFO (10) index = slot << 20, read-only: type | addr dir << 4 | port dir << 5 | V6 << 6 | BANKS << 8 |
--                 LOG2_BUCKETS << 16 | WAYS << 24.
--   SET_CTL (11)  index = slot << 20: bit 0 every lookup of the slot is uncertain (the host's fail safe while it
--                 rewrites the set), set after reset; writing bit 1 clears the slot (every element invalid, every
--                 bank disabled: the sweep again, 2**LOG2_BUCKETS cycles; reads 0); bits 31:8 a tag the host
--                 writes with the contents it loaded and reads back (0 after reset).
-- After every reset a sweep clears the memories (2**LOG2_BUCKETS cycles); until it ends every lookup is uncertain
-- and host requests wait.
-- An IPv6 slot (V6, a dual-stack core's slot of an inet6 set, issue #25): 128-bit addresses from the parsed IPv6
-- header, banks of prefix lengths 0..128, ICMPv6 (58) type << 8 | code as the port (ip_set_get_ip6_port), and the
-- tables SET6_ELEM/SET6_BANK/SET6_INFO/SET6_CTL (18-21) with the same index layout but 8 words per element cell:
-- SET6_ELEM index = slot << 20 | bank << 16 | (bucket * WAYS + way) << 3 | w, w0..w3 the address (bits 127:96
-- first), w4 the flags word (the commit, as w1 above); SET6_BANK's prefix length is bits 7:0. The bucket hash reads
-- the address folded to 32 bits (the XOR of its four words), so both families share set_hash.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;
use work.hf_set_pkg.all;

entity hf_set_table is
  generic (
    SETTYPE      : natural := ST_HASH_NET;  -- hf_set_pkg ST_*
    ADDR_DIR     : natural := 0;            -- address from the source (0) or destination (1)
    PORT_DIR     : natural := 0;            -- port from the source (0) or destination (1)
    BANKS        : positive := 4;           -- hash banks, one prefix length each (1..16)
    LOG2_BUCKETS : positive := 6;           -- buckets per bank = 2**LOG2_BUCKETS (1..13)
    WAYS         : positive := 2;           -- elements per bucket (1, 2, 4 or 8)
    V6           : boolean := false         -- an IPv6 slot: 128-bit addresses, tables SET6_* (18-21)
  );
  port (
    clk       : in  std_logic;
    rst       : in  std_logic;
    h_src     : in  std_logic_vector(addr_w(V6) - 1 downto 0);  -- the IPv4 or (V6) IPv6 header's addresses
    h_dst     : in  std_logic_vector(addr_w(V6) - 1 downto 0);
    h_proto   : in  std_logic_vector(7 downto 0);
    h_sport   : in  std_logic_vector(15 downto 0);
    h_dport   : in  std_logic_vector(15 downto 0);
    h_icmp_type : in std_logic_vector(7 downto 0);
    h_icmp_code : in std_logic_vector(7 downto 0);
    member    : out std_logic;  -- LATENCY cycles after the header
    unc       : out std_logic;  -- the answer is uncertain: the frame must be shunted (reason 3)
    -- indirect access to this slot's tables (the core routes requests whose slot field is this slot); one request
    -- at a time, answered (ind_done) 1 cycle after it, 3 for element reads and w1 writes, later during the sweep
    ind_req   : in  std_logic;
    ind_write : in  std_logic;
    ind_addr  : in  std_logic_vector(31 downto 0);
    ind_wdata : in  std_logic_vector(31 downto 0);
    ind_done  : out std_logic;
    ind_rdata : out std_logic_vector(31 downto 0)
  );
end entity;

architecture rtl of hf_set_table is
  constant HAS_ADDR : boolean := st_has_addr(SETTYPE);
  constant HAS_PORT : boolean := st_has_port(SETTYPE);
  function bits_if(c : boolean; n : natural) return natural is
  begin
    if c then
      return n;
    end if;
    return 0;
  end function;
  constant AW : positive := addr_w(V6);  -- address bits
  constant AWD : natural := bits_if(HAS_ADDR, AW);
  constant MAXLEN : natural := AW;  -- the longest prefix
  constant LENW : positive := 6 + 2 * boolean'pos(V6);  -- bits of a prefix length (0..32, or 0..128)
  constant WB : positive := 1 + 2 * boolean'pos(V6);  -- SET_ELEM index bits of the word in a cell: 1, or 3 (V6)
  constant NW : positive := 2 + 3 * boolean'pos(V6);  -- words of a cell: the address (w0; w0..w3), then the flags
  constant PWD : natural := bits_if(HAS_PORT, 24);
  constant EW : positive := 3 + AWD + PWD;  -- stored element: valid, uncertain, nomatch, address, proto, port
  constant LB : positive := LOG2_BUCKETS;
  constant LW : natural := clog2(WAYS);
  constant BW : positive := WAYS * EW;  -- a bucket: its WAYS elements side by side, way j at bits (j+1)*EW-1..j*EW
  constant T_ELEM : natural := 8 + 10 * boolean'pos(V6);
  constant T_BANK : natural := T_ELEM + 1;
  constant T_INFO : natural := T_ELEM + 2;
  constant T_CTL  : natural := T_ELEM + 3;

  type key_t is record
    a  : std_logic_vector(AW - 1 downto 0);
    pp : std_logic_vector(23 downto 0);  -- proto << 16 | port
  end record;
  type key_arr is array (0 to BANKS - 1) of key_t;
  type bkt_arr is array (0 to BANKS - 1) of unsigned(LB - 1 downto 0);
  type len_arr is array (0 to BANKS - 1) of unsigned(LENW - 1 downto 0);
  type word_arr is array (0 to BANKS - 1) of std_logic_vector(BW - 1 downto 0);

  function prefix_mask(len : unsigned) return std_logic_vector is
    variable m : std_logic_vector(AW - 1 downto 0) := (others => '0');
  begin
    for k in 0 to AW - 1 loop
      if AW - k <= to_integer(len) then
        m(k) := '1';
      end if;
    end loop;
    return m;
  end function;

  function pack(a : std_logic_vector(AW - 1 downto 0); pp : std_logic_vector(23 downto 0);
                flags : std_logic_vector(2 downto 0)) return std_logic_vector is
    variable v : std_logic_vector(EW - 1 downto 0) := (others => '0');
  begin
    v(EW - 1 downto EW - 3) := flags;
    if HAS_PORT then
      for k in 0 to 23 loop
        v(k) := pp(k);
      end loop;
    end if;
    if HAS_ADDR then
      for k in 0 to AW - 1 loop
        v(PWD + k) := a(k);
      end loop;
    end if;
    return v;
  end function;

  function key_of(v : std_logic_vector(EW - 1 downto 0)) return key_t is
    variable r : key_t := ((others => '0'), (others => '0'));
  begin
    if HAS_PORT then
      for k in 0 to 23 loop
        r.pp(k) := v(k);
      end loop;
    end if;
    if HAS_ADDR then
      for k in 0 to AW - 1 loop
        r.a(k) := v(PWD + k);
      end loop;
    end if;
    return r;
  end function;

  -- bank configuration (SET_BANK) and the "longer than" relation between banks, registered off the lookup path
  signal b_en : std_logic_vector(BANKS - 1 downto 0) := (others => '0');
  signal b_len : len_arr := (others => (others => '0'));
  type mask_arr is array (0 to BANKS - 1) of std_logic_vector(AW - 1 downto 0);
  signal b_mask : mask_arr := (others => (others => '0'));  -- prefix_mask(b_len), computed when the host writes it
  type gt_arr is array (0 to BANKS - 1) of std_logic_vector(BANKS - 1 downto 0);
  signal longer : gt_arr := (others => (others => '0'));  -- longer(b)(q): bank q is enabled and longer than bank b
  signal ctl_unc : std_logic := '1';
  signal ctl_tag : std_logic_vector(23 downto 0) := (others => '0');  -- SET_CTL bits 31:8, the host's epoch
  signal recalc : std_logic := '1';  -- a SET_BANK write (or clear, reset): recompute `longer`
  signal sweeping : std_logic := '1';
  signal sw_addr : unsigned(LB - 1 downto 0) := (others => '0');

  -- lookup pipeline
  signal s1_key : key_arr;
  signal s1_bkt : bkt_arr := (others => (others => '0'));
  signal s1_ok, s1_unc : std_logic := '0';
  signal s2_key : key_arr;
  signal s2_ok, s2_unc : std_logic := '0';
  signal lk_word : word_arr;
  signal s3_hit, s3_nom, s3_unc : std_logic_vector(BANKS - 1 downto 0) := (others => '0');
  signal s3_ok, s3_unc0 : std_logic := '0';
  signal r_member, r_unc : std_logic := '0';

  -- host side
  signal we : std_logic_vector(BANKS - 1 downto 0) := (others => '0');
  signal w_addr : unsigned(LB - 1 downto 0) := (others => '0');
  signal w_data : std_logic_vector(BW - 1 downto 0) := (others => '0');
  signal w_new : std_logic_vector(EW - 1 downto 0) := (others => '0');  -- the element a w1 write stores
  signal rmw : std_logic := '0';  -- the bucket read in flight is for a w1 write (read-modify-write)
  signal w0 : std_logic_vector(AW - 1 downto 0) := (others => '0');  -- the address words written (w0..w3 for V6)
  signal h_raddr : unsigned(LB - 1 downto 0) := (others => '0');
  signal hb_word : word_arr;
  signal pend, rd1, rd2 : std_logic := '0';
  signal p_write : std_logic := '0';
  signal p_addr, p_wdata : std_logic_vector(31 downto 0) := (others => '0');
  signal rd_mem : natural range 0 to BANKS - 1 := 0;
  signal rd_way : natural range 0 to WAYS - 1 := 0;
  signal rd_w : natural range 0 to NW - 1 := 0;
  signal done : std_logic := '0';
  signal rdata : std_logic_vector(31 downto 0) := (others => '0');
begin
  assert SETTYPE >= ST_HASH_IP and SETTYPE <= ST_BITMAP_PORT
    report "hf_set_table: SETTYPE must be one of hf_set_pkg's ST_* codes" severity failure;
  assert ADDR_DIR <= 1 and PORT_DIR <= 1 report "hf_set_table: a direction is 0 (src) or 1 (dst)" severity failure;
  assert BANKS <= 16 report "hf_set_table: at most 16 banks (SET_ELEM index bits 19:16)" severity failure;
  assert LB <= 13 report "hf_set_table: LOG2_BUCKETS at most 13" severity failure;
  assert WAYS = 2 ** LW and WAYS <= 8 and LB + LW <= 16 - WB
    report "hf_set_table: WAYS must be 1, 2, 4 or 8, and buckets * WAYS at most 32768 (SET_ELEM index bits 15:1; "
           & "8192 for V6, bits 15:3)" severity failure;

  -- stage 1: the frame's key, masked to each bank's length, and its bucket in that bank
  stage1 : process (clk)
    variable a : std_logic_vector(AW - 1 downto 0);
    variable port_v : std_logic_vector(15 downto 0);
    variable proto_v : std_logic_vector(7 downto 0);
    variable k : key_t;
    variable ok, u : std_logic;
  begin
    if rising_edge(clk) then
      if ADDR_DIR = 0 then
        a := h_src;
      else
        a := h_dst;
      end if;
      proto_v := h_proto;
      ok := '1';
      u := '0';
      port_v := (others => '0');
      if HAS_PORT then
        -- the kernel's ip_set_get_ip4_port: TCP/UDP ports, ICMP type << 8 | code, 0 for protocols without ports;
        -- protocol 0 never matches; SCTP and UDP-Lite carry ports the parser does not read: uncertain. IPv6
        -- (ip_set_get_ip6_port): ICMPv6 type << 8 | code; ICMP (1) is read as ICMP there, whose type and code the
        -- parser does not give for an IPv6 frame: uncertain; no next header (59) never matches
        if h_proto = x"06" or h_proto = x"11" then
          if PORT_DIR = 0 then
            port_v := h_sport;
          else
            port_v := h_dport;
          end if;
        elsif (not V6 and h_proto = x"01") or (V6 and h_proto = x"3A") then
          port_v := h_icmp_type & h_icmp_code;
        elsif h_proto = x"84" or h_proto = x"88" or (V6 and h_proto = x"01") then
          u := '1';
        end if;
        if (not V6 and h_proto = x"00") or (V6 and h_proto = x"3B") then
          ok := '0';
        end if;
      end if;
      if SETTYPE = ST_BITMAP_PORT then
        -- bitmap:port holds ports only and matches TCP and UDP frames alone (ip_set_get_ip_port)
        proto_v := (others => '0');
        if h_proto /= x"06" and h_proto /= x"11" then
          ok := '0';
          u := '0';
        end if;
      end if;
      for b in 0 to BANKS - 1 loop
        k.a := (others => '0');
        if HAS_ADDR then
          k.a := a and b_mask(b);
        end if;
        k.pp := (others => '0');
        if HAS_PORT then
          k.pp := proto_v & port_v;
        end if;
        s1_key(b) <= k;
        s1_bkt(b) <= set_hash(fold32(k.a) & k.pp, LB);
      end loop;
      s1_ok <= ok;
      s1_unc <= u or ctl_unc or sweeping;
    end if;
  end process;

  -- stage 2: the memories read the buckets (registered read ports), one memory per bank, a bucket per word. Two
  -- ports, as a block RAM has them: the host's (write, or read, at one address; read-first) and the lookup's (read).
  -- Not hf_ram with two read ports beside its write port, which synthesis builds from two copies of the memory.
  mems : for m in 0 to BANKS - 1 generate
    type mem_t is array (0 to 2 ** LB - 1) of std_logic_vector(BW - 1 downto 0);
    signal mem : mem_t;  -- no initial contents: the sweep clears it (hf_ram's note)
    signal qa, qb : std_logic_vector(BW - 1 downto 0) := (others => '0');
    signal a_addr : unsigned(LB - 1 downto 0);
  begin
    a_addr <= w_addr when we(m) = '1' else h_raddr;
    port_a : process (clk)
    begin
      if rising_edge(clk) then
        if we(m) = '1' then
          mem(to_integer(a_addr)) <= w_data;
        end if;
        qa <= mem(to_integer(a_addr));
      end if;
    end process;
    port_b : process (clk)
    begin
      if rising_edge(clk) then
        qb <= mem(to_integer(s1_bkt(m)));
      end if;
    end process;
    lk_word(m) <= qb;
    hb_word(m) <= qa;
  end generate;

  stage2 : process (clk)
  begin
    if rising_edge(clk) then
      s2_key <= s1_key;
      s2_ok <= s1_ok;
      s2_unc <= s1_unc;
    end if;
  end process;

  -- stage 3: per bank, the way whose element is the key (at most one: the host never stores a key twice)
  stage3 : process (clk)
    variable w : std_logic_vector(EW - 1 downto 0);
    variable hit, nom, u : std_logic;
  begin
    if rising_edge(clk) then
      for b in 0 to BANKS - 1 loop
        hit := '0';
        nom := '0';
        u := '0';
        for j in 0 to WAYS - 1 loop
          w := lk_word(b)((j + 1) * EW - 1 downto j * EW);
          if w(EW - 1) = '1' and key_of(w) = s2_key(b) then
            hit := '1';
            u := u or w(EW - 2);
            nom := nom or w(EW - 3);
          end if;
        end loop;
        s3_hit(b) <= hit and b_en(b) and s2_ok;
        s3_nom(b) <= nom;
        s3_unc(b) <= u;
      end loop;
      s3_unc0 <= s2_unc;
    end if;
  end process;

  -- stage 4: the longest length that hits decides; any uncertain hit makes the answer uncertain
  stage4 : process (clk)
    variable m, u : std_logic;
  begin
    if rising_edge(clk) then
      m := '0';
      u := s3_unc0;
      for b in 0 to BANKS - 1 loop
        if s3_hit(b) = '1' and (s3_hit and longer(b)) = (BANKS - 1 downto 0 => '0') and s3_nom(b) = '0' then
          m := '1';
        end if;
        u := u or (s3_hit(b) and s3_unc(b));
      end loop;
      r_member <= m;
      r_unc <= u;
    end if;
  end process;
  member <= r_member;
  unc <= r_unc;

  -- host side: SET_* tables, the sweep after reset
  host : process (clk)
    variable tbl : natural;
    variable bank : natural;
    variable ent : unsigned(14 downto 0);
    variable idx : natural;
    variable w1 : std_logic_vector(31 downto 0);
    variable kk : key_t;
    variable sel : std_logic_vector(EW - 1 downto 0);
    variable bword : std_logic_vector(BW - 1 downto 0);
    variable plen : unsigned(LENW - 1 downto 0);
    variable wsel : natural range 0 to 7;
    variable req, wr : std_logic;
    variable addr, wd : std_logic_vector(31 downto 0);
  begin
    if rising_edge(clk) then
      we <= (others => '0');
      done <= '0';
      rd2 <= rd1;
      rd1 <= '0';
      -- the relation changes only with SET_BANK writes: recomputed in the cycle after one (not every cycle, which
      -- the emulator would evaluate for nothing); a lookup in between may still use the old one, as it may the
      -- old bank
      recalc <= '0';
      if recalc = '1' then
        for b in 0 to BANKS - 1 loop
          for q in 0 to BANKS - 1 loop
            longer(b)(q) <= b_en(q) and to_sl(b_len(q) > b_len(b));
          end loop;
        end loop;
      end if;
      req := ind_req or pend;
      wr := ind_write;
      addr := ind_addr;
      wd := ind_wdata;
      if pend = '1' then
        wr := p_write;
        addr := p_addr;
        wd := p_wdata;
      end if;
      if sweeping = '1' then
        we <= (others => '1');
        w_addr <= sw_addr;
        w_data <= (others => '0');
        sw_addr <= sw_addr + 1;
        if sw_addr = 2 ** LB - 1 then
          sweeping <= '0';
        end if;
        if ind_req = '1' then
          pend <= '1';
          p_write <= ind_write;
          p_addr <= ind_addr;
          p_wdata <= ind_wdata;
        end if;
      elsif req = '1' then
        pend <= '0';
        tbl := to_integer(unsigned(addr(31 downto 24)));
        bank := to_integer(unsigned(addr(19 downto 16)));
        if tbl = T_BANK then
          bank := to_integer(unsigned(addr(3 downto 0)));
        end if;
        ent := resize(unsigned(addr(15 downto WB)), 15);
        wsel := to_integer(unsigned(addr(WB - 1 downto 0)));
        idx := to_integer(ent) mod WAYS;
        rdata <= (others => '0');
        if tbl = T_ELEM and bank < BANKS and ent < 2 ** (LB + LW) and wsel < NW then
          if wr = '1' then
            if wsel < NW - 1 then
              -- an address word: w0 (IPv4), or word wsel of the IPv6 address, most significant first
              for q in 0 to NW - 2 loop
                if wsel = q then
                  w0(AW - 1 - 32 * q downto AW - 32 - 32 * q) <= wd;
                end if;
              end loop;
              done <= '1';
            else
              -- the element goes into its way of the bucket: read the bucket, then write it back with the way
              -- replaced (answered then), one memory write
              w_new <= pack(w0, wd(23 downto 0), wd(31 downto 29));
              rmw <= '1';
            end if;
          end if;
          if wr = '0' or wsel = NW - 1 then
            h_raddr <= to_unsigned(to_integer(ent) / WAYS, LB);
            rd_mem <= bank;
            rd_way <= idx;
            rd_w <= wsel;
            rd1 <= '1';
          end if;
        elsif tbl = T_BANK and bank < BANKS then
          if wr = '1' then
            plen := unsigned(wd(LENW - 1 downto 0));
            if plen > MAXLEN then
              plen := to_unsigned(MAXLEN, LENW);
            end if;
            -- each bank's registers written under a constant index: GHDL 2.0 synthesis took b_len and b_mask
            -- written at `bank` for memories and wrote them as combinational loops (docs/hardware.md, GHDL traps)
            for q in 0 to BANKS - 1 loop
              if bank = q then
                b_en(q) <= wd(31);
                b_len(q) <= plen;
                b_mask(q) <= prefix_mask(plen);
              end if;
            end loop;
            recalc <= '1';
          end if;
          rdata <= b_en(bank) & (30 downto LENW => '0') & std_logic_vector(b_len(bank));
          done <= '1';
        elsif tbl = T_INFO then
          rdata <= std_logic_vector(to_unsigned(WAYS, 8))
                   & std_logic_vector(to_unsigned(SETTYPE + 16 * ADDR_DIR + 32 * PORT_DIR + 64 * boolean'pos(V6)
                                                 + 256 * BANKS + 65536 * LB, 24));
          done <= '1';
        elsif tbl = T_CTL then
          if wr = '1' then
            ctl_unc <= wd(0);
            ctl_tag <= wd(31 downto 8);
            if wd(1) = '1' then  -- clear: every element invalid, every bank disabled (the sweep)
              sweeping <= '1';
              sw_addr <= (others => '0');
              b_en <= (others => '0');
              recalc <= '1';
            end if;
          end if;
          rdata <= ctl_tag & "0000000" & ctl_unc;
          done <= '1';
        else
          done <= '1';  -- outside this slot's tables: writes do nothing, reads give 0
        end if;
      end if;
      if rd2 = '1' then
        bword := hb_word(rd_mem);
        sel := (others => '0');
        for j in 0 to WAYS - 1 loop  -- constant slices: no variable-width part select in the netlist
          if rd_way = j then
            sel := bword((j + 1) * EW - 1 downto j * EW);
            if rmw = '1' then
              bword((j + 1) * EW - 1 downto j * EW) := w_new;
            end if;
          end if;
        end loop;
        kk := key_of(sel);
        if rmw = '1' then
          we(rd_mem) <= '1';
          w_addr <= h_raddr;
          w_data <= bword;
          rmw <= '0';
        elsif rd_w < NW - 1 then
          for q in 0 to NW - 2 loop
            if rd_w = q then
              rdata <= kk.a(AW - 1 - 32 * q downto AW - 32 - 32 * q);
            end if;
          end loop;
        else
          w1 := (others => '0');
          w1(31 downto 29) := sel(EW - 1 downto EW - 3);
          w1(23 downto 0) := kk.pp;
          rdata <= w1;
        end if;
        done <= '1';
      end if;
      if rst = '1' then
        sweeping <= '1';
        sw_addr <= (others => '0');
        b_en <= (others => '0');
        recalc <= '1';
        ctl_unc <= '1';
        ctl_tag <= (others => '0');
        pend <= '0';
        rd1 <= '0';
        rd2 <= '0';
        rmw <= '0';
        done <= '0';
      end if;
    end if;
  end process;
  ind_done <= done;
  ind_rdata <= rdata;
end architecture;

-- Header parser: captures the first header bytes of each frame off the stream and extracts the match fields.
-- Non-blocking: it only observes accepted beats and emits at most one header per cycle, 4 cycles after the
-- beat that completes the capture (the beat holding byte 95, or the last beat of a shorter frame).
-- The rules (what counts as unparsed or unfilterable) are the ones of hypafilter.hw.model.parse_frame and
-- .unfilterable; the IPv4 header checksum is summed by adder trees in stages 1 and 2 and checked in stage 3.
-- IPv6 (issue #25, docs/ipv6.md "The NIC's parser"): the extension-header chain is walked as the kernel's
-- ipv6_find_hdr reads it, in the same stages and the same capture (h_family, h6_unparsed, h6_* ports; the IPv4
-- outputs do not change): stage 1 reads, at every 4-byte position after the fixed header, the next-header byte, its
-- class and both possible successors, and takes steps 1 and 2 for both tag positions; stage 2 takes steps
-- 3..V6_MAX_HDRS and checks the fixed header, for both, then chooses the tag's; stage 3 reads the upper-layer bytes
-- and the room tests at the chain's end. A chain it cannot finish within the capture and V6_MAX_HDRS extension
-- headers, any fragment header, a hop-by-hop header first that is not one of the two 8-byte forms below, a payload
-- length of 0 (jumbo) or not ending where the frame ends, and a truncated header are unparsed, never guessed.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_header_parser is
  generic (
    DATA_WIDTH  : positive := 256;  -- TDATA bits: 256 (SUME) or 512 (NetFPGA-PLUS)
    TUSER_WIDTH : positive := 128;  -- TUSER bits (SUME: 128)
    V6_MAX_HDRS : positive := 3;    -- IPv6 extension headers walked at most (the chain's budget, with the capture)
    -- false: the walk is generated out (h6_unparsed stays '1', the other h6_* 0; h_family still follows the
    -- ethertype). hypafilter_core sets it while no matcher reads the h6_* outputs (docs/ipv6.md)
    V6_WALK     : boolean := true;
    -- true: AH is stepped over as ipv6_find_hdr does (legacy ip6tables' -p); false: a chain holding AH is unparsed,
    -- as a core that decides IPv6 frames needs (iptables-nft's -p stops at AH: the back ends disagree there)
    V6_AH       : boolean := true
  );
  port (
    clk        : in  std_logic;
    rst        : in  std_logic;
    beat_valid : in  std_logic;  -- tvalid and tready: a beat is accepted this cycle
    tdata      : in  std_logic_vector(DATA_WIDTH - 1 downto 0);
    tkeep      : in  std_logic_vector(DATA_WIDTH / 8 - 1 downto 0);
    tlast      : in  std_logic;
    tuser      : in  std_logic_vector(TUSER_WIDTH - 1 downto 0);
    h_valid    : out std_logic;  -- one pulse per frame
    h_unparsed : out std_logic;
    h_unfilterable : out std_logic;  -- two VLAN tags, 802.1Q or 802.1ad (also unparsed)
    h_tuser    : out std_logic_vector(TUSER_WIDTH - 1 downto 0);  -- TUSER of the frame's first beat
    h_src      : out std_logic_vector(31 downto 0);
    h_dst      : out std_logic_vector(31 downto 0);
    h_proto    : out std_logic_vector(7 downto 0);
    h_sport    : out std_logic_vector(15 downto 0);
    h_dport    : out std_logic_vector(15 downto 0);
    h_icmp_type : out std_logic_vector(7 downto 0);
    h_icmp_code : out std_logic_vector(7 downto 0);
    h_iport    : out std_logic_vector(1 downto 0);
    h_flags    : out std_logic_vector(7 downto 0);
    -- TCP data offset >= 5 words and within the IPv4 payload, UDP length field >= 8 and within it ('1' for every
    -- other protocol): conntrack's tcp_error/udp_error call a packet failing them INVALID, so it must not hit
    h_l4_ok    : out std_logic;
    -- IPv6 (0x86DD after at most one tag): h_family '1'; h6_unparsed '0' when the walk parsed it, and then the
    -- h6_* fields hold (fields a packet does not carry are 0). The outputs above do not change with these: an IPv6
    -- frame is h_unparsed = '1' there, as before the walk, so a core that reads only them treats it as unparsed.
    h_family    : out std_logic;
    h6_unparsed : out std_logic;
    h6_src      : out std_logic_vector(127 downto 0);  -- bit 127: the first address bit on the wire
    h6_dst      : out std_logic_vector(127 downto 0);
    h6_hlim     : out std_logic_vector(7 downto 0);
    h6_proto    : out std_logic_vector(7 downto 0);  -- the upper-layer protocol ipv6_find_hdr returns (59: none)
    h6_sport    : out std_logic_vector(15 downto 0);
    h6_dport    : out std_logic_vector(15 downto 0);
    h6_icmp_type : out std_logic_vector(7 downto 0);  -- ICMPv6 (58)
    h6_icmp_code : out std_logic_vector(7 downto 0);
    h6_flags    : out std_logic_vector(7 downto 0);
    h6_l4_ok    : out std_logic  -- h_l4_ok's rules against the IPv6 payload's end
  );
end entity;

architecture rtl of hf_header_parser is
  constant BYTES : natural := DATA_WIDTH / 8;
  constant NHB   : natural := (HDR_NEED_BYTES + BYTES - 1) / BYTES;  -- beats captured
  constant HB    : natural := NHB * BYTES;                            -- bytes captured
  subtype buf_t is std_logic_vector(HB * 8 - 1 downto 0);

  function byte(b : buf_t; k : natural) return unsigned is
  begin
    return unsigned(b(8 * k + 7 downto 8 * k));
  end function;

  function u16(b : buf_t; k : natural) return unsigned is
  begin
    return byte(b, k) & byte(b, k + 1);
  end function;

  -- v (NHB words of w'length bits, word 0 at the right) with word number beat replaced by w. Fixed slices selected
  -- by a loop: GHDL 2.0 synthesis drops the register behind a slice whose bounds depend on beat_cnt (simulation
  -- is right, the netlist is not), so never index a variable slice here.
  function with_beat(v : std_logic_vector; beat : natural; w : std_logic_vector) return std_logic_vector is
    variable r : std_logic_vector(v'length - 1 downto 0) := v;
  begin
    for k in 0 to NHB - 1 loop
      if beat = k then
        r((k + 1) * w'length - 1 downto k * w'length) := w;
      end if;
    end loop;
    return r;
  end function;

  -- IPv4 header checksum: 30 words (IHL 15) in 8 groups of up to 4, summed for both places the header can start;
  -- two-level adder trees in stage 1, three levels in stage 2 (a chain of 5 or 6 adders was 10 LUTs deep)
  constant CS_GROUPS : natural := 8;
  type cs_words_t is array (0 to 4 * CS_GROUPS - 1) of unsigned(15 downto 0);
  type cs_groups_t is array (0 to 2 * CS_GROUPS - 1) of unsigned(17 downto 0);  -- CS_GROUPS * tags + group
  type cs_sel_t is array (0 to CS_GROUPS - 1) of unsigned(17 downto 0);

  -- IPv6: an extension header can start at V6_BASE + 4 * j (AH lengths are multiples of 4 bytes, the others of 8;
  -- j = 0 right after an untagged fixed header, j = 1 after a tagged one); J6 is the last position whose next-header
  -- and length bytes lie in the capture, J6 + 1 stands for "beyond it"
  constant V6_BASE : natural := 54;
  constant J6 : natural := (HB - V6_BASE - 2) / 4;
  constant L4_READ : natural := 14;  -- upper-layer bytes read (TCP ports .. flags)
  subtype pos6_t is natural range 0 to J6 + 1;
  type pos6_arr_t is array (0 to J6) of pos6_t;
  type nh6_arr_t is array (0 to J6) of std_logic_vector(7 downto 0);
  type room6_arr_t is array (0 to J6) of unsigned(16 downto 0);
  -- a header type as the walk needs it: ext (ipv6_find_hdr steps over it: ipv6_ext_hdr without NEXTHDR_NONE, which
  -- ends the walk as protocol 59), ah (its length counts 4-byte units), frag
  type cls_t is record
    ext, ah, frag : std_logic;
  end record;
  type cls_arr_t is array (0 to J6) of cls_t;
  -- what stage 1 reads at every position: the next-header byte, its class, and the successor for either type of
  -- the header there (AH or not; the type is the previous header's next-header byte, known only in the walk)
  type tab6_t is record
    nh   : nh6_arr_t;
    c    : cls_arr_t;
    sopt : pos6_arr_t;
    sah  : pos6_arr_t;
  end record;
  -- the walk's state: a header of type nh (class c) starts at position j; bad: the chain cannot be followed
  type walk_t is record
    j   : pos6_t;
    nh  : std_logic_vector(7 downto 0);
    c   : cls_t;
    bad : std_logic;
  end record;
  type walk2_t is array (0 to 1) of walk_t;
  constant WALK_ZERO : walk_t := (0, (others => '0'), ('0', '0', '0'), '0');

  function classify(nh : std_logic_vector(7 downto 0)) return cls_t is
  begin
    return (to_sl(nh = x"00" or nh = x"2B" or nh = x"2C" or nh = x"33" or nh = x"3C"), to_sl(nh = x"33"),
            to_sl(nh = x"2C"));
  end function;

  -- the position after a header at j whose length byte is len: ipv6_authlen, (len + 2) * 4 bytes, for AH, else
  -- ipv6_optlen, (len + 1) * 8 bytes; J6 + 1 when beyond J6. The limit is a constant compare on len, so no adder
  -- lies in front of the saturation
  function succ(j : natural; len : unsigned(7 downto 0); ah : boolean) return pos6_t is
    constant LIM : integer := J6 - j - 2;  -- the most 4-byte units the header may add beyond its first 2
  begin
    if ah then
      if LIM < 0 or len > LIM then
        return J6 + 1;
      end if;
      return j + 2 + to_integer(len(4 downto 0));
    end if;
    if LIM < 0 or len > LIM / 2 then
      return J6 + 1;
    end if;
    return j + 2 + 2 * to_integer(len(3 downto 0));
  end function;

  -- one step of the walk: a fragment header, or an extension header whose bytes are beyond the capture, ends it as
  -- bad; an upper-layer protocol (59 included) ends it as found; else the next header at the successor
  function step(w : walk_t; t : tab6_t) return walk_t is
    variable r : walk_t := w;
    variable nxt : std_logic_vector(7 downto 0) := (others => '0');
    variable nc : cls_t := ('0', '0', '0');
    variable so, sa : pos6_t := 0;
  begin
    if w.bad = '0' and w.c.ext = '1' then
      if w.c.frag = '1' or w.j > J6 or (w.c.ah = '1' and not V6_AH) then
        r.bad := '1';
      else
        for k in 0 to J6 loop  -- fixed indices selected in a loop (no variable slice)
          if w.j = k then
            nxt := t.nh(k);
            nc := t.c(k);
            so := t.sopt(k);
            sa := t.sah(k);
          end if;
        end loop;
        if w.c.ah = '1' then
          r.j := sa;
        else
          r.j := so;
        end if;
        r.nh := nxt;
        r.c := nc;
      end if;
    end if;
    return r;
  end function;

  -- capture
  signal beat_cnt : natural range 0 to NHB := 0;
  signal hbuf      : buf_t := (others => '0');
  signal tuser_q  : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  signal have     : std_logic_vector(HB - 1 downto 0) := (others => '0');  -- byte k was received
  -- stage C: a complete capture
  signal c_v : std_logic := '0';
  signal c_buf : buf_t := (others => '0');
  signal c_have : std_logic_vector(HB - 1 downto 0) := (others => '0');
  signal c_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  -- stage 1: Ethernet and VLAN tags
  signal p1_v, p1_ip, p1_unf : std_logic := '0';
  signal p1_l3 : natural range 0 to 1 := 0;  -- tags before the IPv4 header
  signal p1_cs : cs_groups_t := (others => (others => '0'));
  signal p1_buf : buf_t := (others => '0');
  signal p1_have : std_logic_vector(HB - 1 downto 0) := (others => '0');
  signal p1_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  signal p1_fam6, p1_ip6 : std_logic := '0';
  signal p1_t6 : tab6_t := ((others => (others => '0')), (others => ('0', '0', '0')), (others => 0), (others => 0));
  signal p1_w6 : walk2_t := (others => WALK_ZERO);  -- after the first two steps, per tag position
  -- stage 2: IPv4 header
  signal p2_v, p2_ok, p2_unf : std_logic := '0';
  signal p2_cs : unsigned(20 downto 0) := (others => '0');  -- sum of the header's words (30 * 0xFFFF < 2 ** 21)
  signal p2_buf : buf_t := (others => '0');
  signal p2_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  signal p2_l4sel : natural range 0 to 11 := 0;  -- L4 offset = 34 + 4 * p2_l4sel
  signal p2_l4room : unsigned(15 downto 0) := (others => '0');  -- IPv4 payload bytes (total length - IHL*4)
  signal p2_proto : std_logic_vector(7 downto 0) := (others => '0');
  signal p2_src, p2_dst : std_logic_vector(31 downto 0) := (others => '0');
  -- stage 2: IPv6 header and the rest of the walk
  signal p2_fam6, p2_ok6 : std_logic := '0';
  signal p2_j6 : pos6_t := 0;
  signal p2_nh6, p2_hlim : std_logic_vector(7 downto 0) := (others => '0');
  signal p2_room6 : room6_arr_t := (others => (others => '0'));  -- frame length - (V6_BASE + 4 * j), bit 16: < 0
  signal p2_src6, p2_dst6 : std_logic_vector(127 downto 0) := (others => '0');
  -- stage 3: output
  signal o_v, o_unp, o_unf : std_logic := '0';
  signal o_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  signal o_src, o_dst : std_logic_vector(31 downto 0) := (others => '0');
  signal o_proto, o_it, o_ic, o_flags : std_logic_vector(7 downto 0) := (others => '0');
  signal o_sport, o_dport : std_logic_vector(15 downto 0) := (others => '0');
  signal o_iport : std_logic_vector(1 downto 0) := (others => '0');
  signal o_l4ok : std_logic := '1';
  signal o_fam6, o_l4ok6 : std_logic := '0';
  signal o_unp6 : std_logic := '1';
  signal o_src6, o_dst6 : std_logic_vector(127 downto 0) := (others => '0');
  signal o_hlim, o_proto6, o_it6, o_ic6, o_flags6 : std_logic_vector(7 downto 0) := (others => '0');
  signal o_sport6, o_dport6 : std_logic_vector(15 downto 0) := (others => '0');
begin
  assert DATA_WIDTH = 256 or DATA_WIDTH = 512
    report "hf_header_parser: DATA_WIDTH must be 256 or 512" severity failure;
  assert TUSER_WIDTH >= 128 report "hf_header_parser: TUSER_WIDTH must be at least 128" severity failure;

  capture : process (clk)
    variable nb : buf_t;
    variable nh : std_logic_vector(HB - 1 downto 0);
  begin
    if rising_edge(clk) then
      c_v <= '0';
      if beat_valid = '1' then
        if beat_cnt < NHB then
          nb := with_beat(hbuf, beat_cnt, tdata);
          hbuf <= nb;
          -- which bytes exist: TKEEP is contiguous from byte 0, so a byte-valid mask replaces a byte count
          -- (a popcount here was 46 LUT levels deep)
          nh := have;
          if beat_cnt = 0 then
            nh := (others => '0');
          end if;
          nh := with_beat(nh, beat_cnt, tkeep);
          have <= nh;
          if beat_cnt = 0 then
            tuser_q <= tuser;
          end if;
          if tlast = '1' or beat_cnt = NHB - 1 then
            c_v <= '1';
            c_buf <= nb;
            c_have <= nh;
            if beat_cnt = 0 then
              c_tuser <= tuser;
            else
              c_tuser <= tuser_q;
            end if;
          end if;
        end if;
        if tlast = '1' then
          beat_cnt <= 0;
        elsif beat_cnt < NHB then
          beat_cnt <= beat_cnt + 1;
        end if;
      end if;
      if rst = '1' then
        beat_cnt <= 0;
        c_v <= '0';
      end if;
    end if;
  end process;

  ethernet : process (clk)
    variable et, inner : unsigned(15 downto 0);
    variable tag, unf, ll : boolean;
    variable ihl : unsigned(3 downto 0);
    variable w : cs_words_t;
    variable len6 : unsigned(7 downto 0);
    variable t6 : tab6_t;
    variable w6 : walk_t;
    variable hbh_ok, fam6 : boolean;
  begin
    if rising_edge(clk) then
      et := u16(c_buf, 12);
      inner := u16(c_buf, 16);
      -- the kernel pops one tag (either TPID) before br_netfilter looks: two tags leave a tagged frame that no
      -- iptables rule sees, so the frame is unfilterable
      tag := et = x"8100" or et = x"88A8";
      unf := tag and c_have(17) = '1' and (inner = x"8100" or inner = x"88A8");
      if tag then
        et := inner;
      end if;
      -- 01:80:C2:00:00:00..0F, the link-local groups the Linux bridge handles itself
      ll := byte(c_buf, 0) = x"01" and byte(c_buf, 1) = x"80" and byte(c_buf, 2) = x"C2" and byte(c_buf, 3) = x"00"
            and byte(c_buf, 4) = x"00" and c_buf(47 downto 44) = "0000";
      p1_v <= c_v and not rst;
      p1_ip <= to_sl(et = x"0800" and not unf and not ll);
      p1_unf <= to_sl(unf);
      if tag then
        p1_l3 <= 1;
      else
        p1_l3 <= 0;
      end if;
      -- checksum partial sums for both header positions (the tag decision is not known before this edge): the
      -- 10 fixed words always, option words 10..29 only below IHL * 2, the 2 words of padding never
      for t in 0 to 1 loop
        ihl := unsigned(c_buf(8 * (14 + 4 * t) + 3 downto 8 * (14 + 4 * t)));
        for i in 0 to 4 * CS_GROUPS - 1 loop
          w(i) := (others => '0');
          if i < 10 or (i < 30 and ihl > i / 2) then
            w(i) := u16(c_buf, 14 + 4 * t + 2 * i);
          end if;
        end loop;
        for g in 0 to CS_GROUPS - 1 loop
          p1_cs(CS_GROUPS * t + g) <= resize(resize(w(4 * g), 17) + w(4 * g + 1), 18)
                                      + (resize(w(4 * g + 2), 17) + w(4 * g + 3));
        end loop;
      end loop;
      -- IPv6: at every position the next-header byte and both successors (the header's type, known only in the
      -- walk, chooses), then the first step for both places the fixed header can start
      -- (the capture holds stale bytes past a short frame's end: the ethertype must have been received)
      fam6 := et = x"86DD" and c_have(13) = '1' and (not tag or c_have(17) = '1');
      p1_fam6 <= to_sl(fam6);
      p1_ip6 <= to_sl(fam6 and not unf and not ll);
      if V6_WALK then
      for j in 0 to J6 loop
        t6.nh(j) := std_logic_vector(byte(c_buf, V6_BASE + 4 * j));
        t6.c(j) := classify(t6.nh(j));
        len6 := byte(c_buf, V6_BASE + 4 * j + 1);
        t6.sopt(j) := succ(j, len6, false);
        t6.sah(j) := succ(j, len6, true);
      end loop;
      for t in 0 to 1 loop
        w6 := (t, std_logic_vector(byte(c_buf, 20 + 4 * t)), classify(std_logic_vector(byte(c_buf, 20 + 4 * t))), '0');
        -- a hop-by-hop header first is judged before any rule (br_netfilter's nf_ip6_check_hbh_len, or
        -- ip6_parse_tlv on the host's input path: jumbo payload, malformed or unknown options): walked only in the
        -- two 8-byte forms both accept, PadN of 4 zero bytes and a Router Alert followed by PadN of 0 (MLD)
        if w6.nh = x"00" then
          hbh_ok := byte(c_buf, V6_BASE + 4 * t + 1) = x"00"
                    and ((byte(c_buf, V6_BASE + 4 * t + 2) = x"01" and byte(c_buf, V6_BASE + 4 * t + 3) = x"04"
                          and u16(c_buf, V6_BASE + 4 * t + 4) = x"0000" and u16(c_buf, V6_BASE + 4 * t + 6) = x"0000")
                         or (byte(c_buf, V6_BASE + 4 * t + 2) = x"05" and byte(c_buf, V6_BASE + 4 * t + 3) = x"02"
                             and byte(c_buf, V6_BASE + 4 * t + 6) = x"01" and byte(c_buf, V6_BASE + 4 * t + 7) = x"00"));
          if not hbh_ok then
            w6.bad := '1';
          end if;
        end if;
        -- steps 1 and 2 here (the first at a fixed position), the rest in stage 2
        for s in 1 to minimum(2, V6_MAX_HDRS) loop
          w6 := step(w6, t6);
        end loop;
        p1_w6(t) <= w6;
      end loop;
      p1_t6 <= t6;
      end if;
      p1_buf <= c_buf;
      p1_have <= c_have;
      p1_tuser <= c_tuser;
    end if;
  end process;

  ipv6 : process (clk)
    variable ip, ipt : std_logic_vector(319 downto 0);  -- the 40 fixed IPv6 header bytes, byte 0 in bits 7..0
    variable w6, wt : walk_t;
    variable plen : unsigned(15 downto 0);
    variable ok, okt : boolean;
  begin
    if rising_edge(clk) then
      if V6_WALK then
      -- the rest of the walk and the fixed header's checks for both tag positions, then the tag's: the 2-way
      -- choice comes last, off the walk's path
      ip := (others => '0');
      w6 := WALK_ZERO;
      ok := false;
      for t in 0 to 1 loop
        ipt := p1_buf(8 * (14 + 4 * t) + 319 downto 8 * (14 + 4 * t));
        wt := p1_w6(t);
        for s in 3 to V6_MAX_HDRS loop
          wt := step(wt, p1_t6);
        end loop;
        plen := unsigned(ipt(39 downto 32)) & unsigned(ipt(47 downto 40));
        -- version 6; a payload length of 0 is a jumbogram (or nothing): br_netfilter and ip6_rcv_core judge it;
        -- the payload ends where the frame ends (br_validate_ipv6 trims bytes after it: the kernel would forward a
        -- shorter frame); the walk found an upper-layer protocol within the budget
        okt := p1_have(14 + 4 * t + 39) = '1' and ipt(7 downto 4) = "0110" and plen /= 0
               and resize(plen, 17) + (54 + 4 * t) = resize(unsigned(p1_tuser(TUSER_LEN_LO + 15 downto TUSER_LEN_LO)), 17)
               and wt.bad = '0' and wt.c.ext = '0' and wt.j <= J6;
        if p1_l3 = t then
          ip := ipt;
          w6 := wt;
          ok := okt;
        end if;
      end loop;
      for j in 0 to J6 loop
        p2_room6(j) <= resize(unsigned(p1_tuser(TUSER_LEN_LO + 15 downto TUSER_LEN_LO)), 17) - (V6_BASE + 4 * j);
      end loop;
      p2_fam6 <= p1_fam6;
      p2_ok6 <= to_sl(p1_ip6 = '1' and ok);
      p2_j6 <= w6.j;
      p2_nh6 <= w6.nh;
      p2_hlim <= ip(63 downto 56);
      for i in 0 to 15 loop
        p2_src6(127 - 8 * i downto 120 - 8 * i) <= ip(8 * (8 + i) + 7 downto 8 * (8 + i));
        p2_dst6(127 - 8 * i downto 120 - 8 * i) <= ip(8 * (24 + i) + 7 downto 8 * (24 + i));
      end loop;
      end if;
    end if;
  end process;

  ipv4 : process (clk)
    variable ip : std_logic_vector(159 downto 0);  -- the 20 fixed IPv4 header bytes, byte 0 in bits 7..0
    variable ihl : unsigned(3 downto 0);
    variable total : unsigned(15 downto 0);
    variable l3 : natural range 14 to 18;
    variable present : std_logic;  -- the last fixed IPv4 header byte was received
    variable ok : boolean;
    variable gs : cs_sel_t;
  begin
    if rising_edge(clk) then
      -- constant slices selected in a loop: a multiplexer, which GHDL synthesises without dynamic slicing
      ip := (others => '0');
      present := '0';
      gs := (others => (others => '0'));
      for t in 0 to 1 loop
        if p1_l3 = t then
          ip := p1_buf(8 * (14 + 4 * t) + 159 downto 8 * (14 + 4 * t));
          present := p1_have(14 + 4 * t + 19);
          for g in 0 to CS_GROUPS - 1 loop
            gs(g) := p1_cs(CS_GROUPS * t + g);
          end loop;
        end if;
      end loop;
      l3 := 14 + 4 * p1_l3;
      ihl := unsigned(ip(3 downto 0));
      total := unsigned(ip(23 downto 16)) & unsigned(ip(31 downto 24));
      ok := p1_ip = '1'
            and present = '1'
            and ip(7 downto 4) = "0100"
            and ihl >= 5
            and total >= resize(ihl & "00", 16)
            -- the datagram ends where the frame ends: br_netfilter trims bytes after it before the filter runs, so
            -- the kernel forwards a shorter frame than the one received; netfilter must forward it (unparsed)
            and resize(total, 17) + l3 = resize(unsigned(p1_tuser(TUSER_LEN_LO + 15 downto TUSER_LEN_LO)), 17)
            and ip(53 downto 48) & ip(63 downto 56) = "00000000000000";  -- no MF, no offset: not a fragment
      p2_v <= p1_v and not rst;
      p2_ok <= to_sl(ok);
      p2_unf <= p1_unf;
      p2_cs <= resize(resize(resize(gs(0), 19) + gs(1), 20) + (resize(gs(2), 19) + gs(3)), 21)
               + (resize(resize(gs(4), 19) + gs(5), 20) + (resize(gs(6), 19) + gs(7)));
      -- (l3 - 14) / 4 + (ihl - 5): the 12 possible L4 offsets 34, 38, ... 78
      if ihl >= 5 then
        p2_l4sel <= p1_l3 + to_integer(ihl) - 5;
      else
        p2_l4sel <= 0;
      end if;
      p2_l4room <= total - resize(ihl & "00", 16);
      p2_proto <= ip(79 downto 72);
      p2_src <= ip(103 downto 96) & ip(111 downto 104) & ip(119 downto 112) & ip(127 downto 120);
      p2_dst <= ip(135 downto 128) & ip(143 downto 136) & ip(151 downto 144) & ip(159 downto 152);
      p2_buf <= p1_buf;
      p2_tuser <= p1_tuser;
    end if;
  end process;

  transport_layer : process (clk)
    variable l4b : std_logic_vector(111 downto 0);  -- the first 14 L4 bytes
    variable need : natural range 0 to 20;
    variable is_tcp, is_udp, is_icmp : boolean;
    variable sp : std_logic_vector(7 downto 0);
    variable cs_ok : boolean;
    variable doff : unsigned(3 downto 0);
    variable ulen : unsigned(15 downto 0);
    variable l4b6, lb : std_logic_vector(8 * L4_READ - 1 downto 0);
    variable fit, is_tcp6, is_udp6, is_icmp6, g0, g8, g20, tcp_ok, udp_ok, room_ok : boolean;
    variable room6 : unsigned(16 downto 0);  -- payload end - upper-layer offset at a position; bit 16: negative
    variable doff6 : unsigned(3 downto 0);
    variable ulen6 : unsigned(15 downto 0);
  begin
    if rising_edge(clk) then
      l4b := (others => '0');
      for i in 0 to 11 loop
        if p2_l4sel = i then
          l4b := p2_buf(8 * (34 + 4 * i) + 111 downto 8 * (34 + 4 * i));
        end if;
      end loop;
      is_tcp := p2_proto = x"06";
      is_udp := p2_proto = x"11";
      is_icmp := p2_proto = x"01";
      -- the kernel's minimum L4 header sizes (xt_tcpudp, icmp match hotdrop anything shorter): a shorter header
      -- is netfilter's to judge, so it is shunted unparsed; only the first 14 bytes are read, the rest may lie
      -- beyond the capture and are checked against the IPv4 total length (itself checked against the frame)
      if is_tcp then
        need := 20;
      elsif is_udp then
        need := 8;
      elsif is_icmp then
        need := 8;
      else
        need := 0;
      end if;
      -- ip_fast_csum's fold gives 0xFFFF exactly when low + high = 0xFFFF (the sum is below 2 ** 21, so high is 5
      -- bits): the low half is 0xFFE0 + (31 - high), i.e. bits 15..5 set and bits 4..0 the complement of high
      cs_ok := p2_cs(15 downto 5) = "11111111111" and p2_cs(4 downto 0) = not p2_cs(20 downto 16);
      o_v <= p2_v and not rst;
      o_unp <= not (p2_ok and to_sl(p2_l4room >= need) and to_sl(cs_ok));
      o_unf <= p2_unf;
      o_tuser <= p2_tuser;
      o_src <= p2_src;
      o_dst <= p2_dst;
      o_proto <= p2_proto;
      o_sport <= (others => '0');
      o_dport <= (others => '0');
      o_it <= (others => '0');
      o_ic <= (others => '0');
      o_flags <= (others => '0');
      if is_tcp or is_udp then
        o_sport <= l4b(7 downto 0) & l4b(15 downto 8);
        o_dport <= l4b(23 downto 16) & l4b(31 downto 24);
      end if;
      if is_tcp then
        o_flags <= l4b(111 downto 104);
      end if;
      doff := unsigned(l4b(103 downto 100));
      ulen := unsigned(l4b(39 downto 32)) & unsigned(l4b(47 downto 40));
      o_l4ok <= '1';
      if is_tcp then
        o_l4ok <= to_sl(doff >= 5 and resize(doff & "00", 16) <= p2_l4room);
      elsif is_udp then
        o_l4ok <= to_sl(ulen >= 8 and ulen <= p2_l4room);
      end if;
      if is_icmp then
        o_it <= l4b(7 downto 0);
        o_ic <= l4b(15 downto 8);
      end if;
      -- IPv6: the upper-layer header at the walk's end, the same minimum sizes (tcp_mt, udp_mt, icmp6_match
      -- hotdrop shorter ones), against the payload's end (= the frame's end, checked in stage 2); the bytes read must
      -- lie in the capture
      -- per position: the upper-layer bytes, and the length tests against that position's room (in parallel, so
      -- that only single bits are selected by the walk's end)
      if V6_WALK then
      l4b6 := (others => '0');
      fit := false;
      g0 := false;
      g8 := false;
      g20 := false;
      tcp_ok := false;
      udp_ok := false;
      is_tcp6 := p2_nh6 = x"06";
      is_udp6 := p2_nh6 = x"11";
      is_icmp6 := p2_nh6 = x"3A";
      for j in 0 to J6 loop
        lb := (others => '0');
        for i in 0 to L4_READ - 1 loop
          if V6_BASE + 4 * j + i < HB then
            lb(8 * i + 7 downto 8 * i) := p2_buf(8 * (V6_BASE + 4 * j + i) + 7 downto 8 * (V6_BASE + 4 * j + i));
          end if;
        end loop;
        room6 := p2_room6(j);
        doff6 := unsigned(lb(103 downto 100));
        ulen6 := unsigned(lb(39 downto 32)) & unsigned(lb(47 downto 40));
        if p2_j6 = j then
          l4b6 := lb;
          g0 := room6(16) = '0';
          g8 := room6(16) = '0' and room6 >= 8;
          g20 := room6(16) = '0' and room6 >= 20;
          tcp_ok := doff6 >= 5 and resize(doff6 & "00", 17) <= room6;
          udp_ok := ulen6 >= 8 and resize(ulen6, 17) <= room6;
          if is_tcp6 then
            fit := V6_BASE + 4 * j + 14 <= HB;
          elsif is_udp6 then
            fit := V6_BASE + 4 * j + 4 <= HB;
          elsif is_icmp6 then
            fit := V6_BASE + 4 * j + 2 <= HB;
          else
            fit := true;
          end if;
        end if;
      end loop;
      if is_tcp6 then
        room_ok := g20;
      elsif is_udp6 or is_icmp6 then
        room_ok := g8;
      else
        room_ok := g0;
      end if;
      o_fam6 <= p2_fam6;
      o_unp6 <= not (p2_fam6 and p2_ok6 and to_sl(fit and room_ok));
      o_src6 <= p2_src6;
      o_dst6 <= p2_dst6;
      o_hlim <= p2_hlim;
      o_proto6 <= p2_nh6;
      o_sport6 <= (others => '0');
      o_dport6 <= (others => '0');
      o_it6 <= (others => '0');
      o_ic6 <= (others => '0');
      o_flags6 <= (others => '0');
      if is_tcp6 or is_udp6 then
        o_sport6 <= l4b6(7 downto 0) & l4b6(15 downto 8);
        o_dport6 <= l4b6(23 downto 16) & l4b6(31 downto 24);
      end if;
      if is_tcp6 then
        o_flags6 <= l4b6(111 downto 104);
      end if;
      if is_icmp6 then
        o_it6 <= l4b6(7 downto 0);
        o_ic6 <= l4b6(15 downto 8);
      end if;
      o_l4ok6 <= '1';
      if is_tcp6 then
        o_l4ok6 <= to_sl(tcp_ok);
      elsif is_udp6 then
        o_l4ok6 <= to_sl(udp_ok);
      end if;
      end if;
      sp := p2_tuser(TUSER_SRC_LO + 7 downto TUSER_SRC_LO);
      -- ifs, not a case: GHDL 2.0's Verilog drops a case's `when others` (MAC0 here), a latch in the emulator's
      -- model that gave a MAC0 frame the iport of the MAC1 frame before it (tests/system/test_emu_iport.py)
      o_iport <= "00";
      if sp = x"04" then
        o_iport <= "01";
      end if;
      if sp = x"10" then
        o_iport <= "10";
      end if;
      if sp = x"40" then
        o_iport <= "11";
      end if;
    end if;
  end process;

  h_valid <= o_v;
  h_unparsed <= o_unp;
  h_unfilterable <= o_unf;
  h_tuser <= o_tuser;
  h_src <= o_src;
  h_dst <= o_dst;
  h_proto <= o_proto;
  h_sport <= o_sport;
  h_dport <= o_dport;
  h_icmp_type <= o_it;
  h_icmp_code <= o_ic;
  h_iport <= o_iport;
  h_flags <= o_flags;
  h_l4_ok <= o_l4ok;
  h_family <= o_fam6;
  h6_unparsed <= o_unp6;
  h6_src <= o_src6;
  h6_dst <= o_dst6;
  h6_hlim <= o_hlim;
  h6_proto <= o_proto6;
  h6_sport <= o_sport6;
  h6_dport <= o_dport6;
  h6_icmp_type <= o_it6;
  h6_icmp_code <= o_ic6;
  h6_flags <= o_flags6;
  h6_l4_ok <= o_l4ok6;
end architecture;

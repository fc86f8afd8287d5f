-- Shared constants of the set membership tables (hf_set_table): set type codes, the element key and the bucket
-- hash. hypafilter.hw.settable is the Python side of every definition here (the host places elements by this hash).
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

package hf_set_pkg is
  -- set types (hypafilter.hw.settable.SETTYPES)
  constant ST_HASH_IP       : natural := 1;
  constant ST_HASH_NET      : natural := 2;
  constant ST_HASH_IP_PORT  : natural := 3;
  constant ST_HASH_NET_PORT : natural := 4;
  constant ST_BITMAP_PORT   : natural := 5;

  constant KEY_W : natural := 56;  -- element key: address << 24 | proto << 16 | port
  constant MAX_HASH_BITS : natural := 16;

  -- address bits of a slot: 32, or 128 for an IPv6 slot (hf_set_table's V6)
  function addr_w(v6 : boolean) return positive;
  -- an address folded to the 32 bits the bucket hash reads: itself, or the XOR of an IPv6 address's four words
  function fold32(a : std_logic_vector) return std_logic_vector;
  function st_has_addr(t : natural) return boolean;
  function st_has_port(t : natural) return boolean;
  -- bucket of a key: H3 hashing, bit i = parity(key and row i), rows from xorshift64 (settable.HASH_ROWS)
  function set_hash(key : std_logic_vector(KEY_W - 1 downto 0); bits : natural) return unsigned;
end package;

package body hf_set_pkg is
  function addr_w(v6 : boolean) return positive is
  begin
    if v6 then
      return 128;
    end if;
    return 32;
  end function;

  function fold32(a : std_logic_vector) return std_logic_vector is
    variable v : std_logic_vector(a'length - 1 downto 0) := a;
    variable r : std_logic_vector(31 downto 0) := (others => '0');
  begin
    for q in 0 to a'length / 32 - 1 loop
      r := r xor v(32 * q + 31 downto 32 * q);
    end loop;
    return r;
  end function;
  function st_has_addr(t : natural) return boolean is
  begin
    return t /= ST_BITMAP_PORT;
  end function;

  function st_has_port(t : natural) return boolean is
  begin
    return t = ST_HASH_IP_PORT or t = ST_HASH_NET_PORT or t = ST_BITMAP_PORT;
  end function;

  -- row i of the hash matrix, half `half` (28 bits): of the (i + 1)-th output of xorshift64 from a fixed seed, the
  -- low KEY_W bits. A function of constants returning at most 32 bits, not a constant array or a 56-bit row: GHDL
  -- 2.0's Verilog netlist writes a constant wider than 32 bits as a quoted string, which Verilog reads as ASCII
  -- characters (every key hashed wrongly in the emulator while the VHDL netlist was right; docs/hardware.md)
  function hash_row(i : natural; half : natural) return std_logic_vector is
    variable x : unsigned(63 downto 0) := x"9E3779B97F4A7C15";
  begin
    for k in 0 to i loop
      x := x xor shift_left(x, 13);
      x := x xor shift_right(x, 7);
      x := x xor shift_left(x, 17);
    end loop;
    return std_logic_vector(x(28 * half + 27 downto 28 * half));
  end function;

  function set_hash(key : std_logic_vector(KEY_W - 1 downto 0); bits : natural) return unsigned is
    variable h : unsigned(bits - 1 downto 0);
  begin
    -- per bit one XOR reduction of each 28-bit half of the key masked by the row
    for i in 0 to bits - 1 loop
      h(i) := (xor (key(27 downto 0) and hash_row(i, 0))) xor (xor (key(55 downto 28) and hash_row(i, 1)));
    end loop;
    return h;
  end function;
end package body;

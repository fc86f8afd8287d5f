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

  function st_has_addr(t : natural) return boolean;
  function st_has_port(t : natural) return boolean;
  -- bucket of a key: H3 hashing, bit i = parity(key and HASH_ROW(i)), rows from xorshift64 (settable.hash_rows)
  function set_hash(key : std_logic_vector(KEY_W - 1 downto 0); bits : natural) return unsigned;
end package;

package body hf_set_pkg is
  function st_has_addr(t : natural) return boolean is
  begin
    return t /= ST_BITMAP_PORT;
  end function;

  function st_has_port(t : natural) return boolean is
  begin
    return t = ST_HASH_IP_PORT or t = ST_HASH_NET_PORT or t = ST_BITMAP_PORT;
  end function;

  type row_arr is array (0 to MAX_HASH_BITS - 1) of std_logic_vector(KEY_W - 1 downto 0);

  function hash_rows return row_arr is
    variable x : unsigned(63 downto 0) := x"9E3779B97F4A7C15";
    variable r : row_arr;
  begin
    for i in 0 to MAX_HASH_BITS - 1 loop
      x := x xor shift_left(x, 13);
      x := x xor shift_right(x, 7);
      x := x xor shift_left(x, 17);
      r(i) := std_logic_vector(x(KEY_W - 1 downto 0));
    end loop;
    return r;
  end function;
  constant HASH_ROW : row_arr := hash_rows;

  function set_hash(key : std_logic_vector(KEY_W - 1 downto 0); bits : natural) return unsigned is
    variable h : unsigned(bits - 1 downto 0);
  begin
    -- one reduction per bit: a single XOR of the selected key bits in synthesis and in the emulator's Verilog
    for i in 0 to bits - 1 loop
      h(i) := xor (key and HASH_ROW(i));
    end loop;
    return h;
  end function;
end package body;

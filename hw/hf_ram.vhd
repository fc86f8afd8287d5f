-- A memory with one write port and READS registered read ports (block or distributed RAM): the one description
-- that the FIFO, the tables and the flow cache instantiate, so that synthesis sees every memory the same way.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

entity hf_ram is
  generic (
    WIDTH  : positive := 8;  -- bits per word
    ADDR_W : positive := 4;  -- address bits: 2**ADDR_W words
    READS  : positive := 1   -- read ports; port i is slice i (from the right) of raddr, re and rdata
  );
  port (
    clk   : in  std_logic;
    we    : in  std_logic;
    waddr : in  unsigned(ADDR_W - 1 downto 0);
    wdata : in  std_logic_vector(WIDTH - 1 downto 0);
    re    : in  std_logic_vector(READS - 1 downto 0) := (others => '1');  -- low: that port's rdata holds
    raddr : in  unsigned(READS * ADDR_W - 1 downto 0);
    -- the word at raddr one cycle later; a read of the word written in the same cycle returns the old word
    rdata : out std_logic_vector(READS * WIDTH - 1 downto 0)
  );
end entity;

architecture rtl of hf_ram is
  type mem_t is array (0 to 2 ** ADDR_W - 1) of std_logic_vector(WIDTH - 1 downto 0);
  -- No initial contents: GHDL's netlist drops a RAM's initial value, and an all-zero initial value of a 64k-word
  -- memory made GHDL's simulation run out of stack. Users that need known contents sweep them after reset.
  signal mem : mem_t;
  signal q : std_logic_vector(READS * WIDTH - 1 downto 0) := (others => '0');
begin
  ram : process (clk)
  begin
    if rising_edge(clk) then
      if we = '1' then
        mem(to_integer(waddr)) <= wdata;
      end if;
      for i in 0 to READS - 1 loop
        if re(i) = '1' then
          q((i + 1) * WIDTH - 1 downto i * WIDTH) <= mem(to_integer(raddr((i + 1) * ADDR_W - 1 downto i * ADDR_W)));
        end if;
      end loop;
    end if;
  end process;
  rdata <= q;
end architecture;

-- Synchronous first-word-fall-through FIFO on a block-RAM style memory (registered read), one word per cycle.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_fifo is
  generic (
    WIDTH : positive := 8;  -- bits per word
    DEPTH : positive := 16  -- words in the memory (a power of two); two more are held in the read pipeline
  );
  port (
    clk       : in  std_logic;
    rst       : in  std_logic;  -- synchronous, active high
    in_data   : in  std_logic_vector(WIDTH - 1 downto 0);
    in_valid  : in  std_logic;
    in_ready  : out std_logic;  -- low only when the memory is full
    out_data  : out std_logic_vector(WIDTH - 1 downto 0);
    out_valid : out std_logic;
    out_ready : in  std_logic
  );
end entity;

architecture rtl of hf_fifo is
  constant AW : natural := clog2(DEPTH);
  signal wr_ptr, rd_ptr : unsigned(AW - 1 downto 0) := (others => '0');
  signal count : unsigned(AW downto 0) := (others => '0');
  signal r_data : std_logic_vector(WIDTH - 1 downto 0);
  signal o_data : std_logic_vector(WIDTH - 1 downto 0) := (others => '0');
  signal r_v, o_v : std_logic := '0';
  signal full, wr_en, rd_en, move, pop : std_logic;
begin
  assert 2 ** AW = DEPTH and DEPTH >= 2 report "hf_fifo: DEPTH must be a power of two >= 2" severity failure;

  full <= '1' when count = DEPTH else '0';
  in_ready <= not full;
  wr_en <= in_valid and not full;
  pop <= o_v and out_ready;
  move <= r_v and (not o_v or pop);
  rd_en <= '1' when count /= 0 and (r_v = '0' or move = '1') else '0';

  ram : entity work.hf_ram
    generic map (WIDTH => WIDTH, ADDR_W => AW)
    port map (clk => clk, we => wr_en, waddr => wr_ptr, wdata => in_data, re(0) => rd_en, raddr => rd_ptr,
              rdata => r_data);

  ctrl : process (clk)
  begin
    if rising_edge(clk) then
      if wr_en = '1' then
        wr_ptr <= wr_ptr + 1;
      end if;
      if rd_en = '1' then
        rd_ptr <= rd_ptr + 1;
      end if;
      if wr_en = '1' and rd_en = '0' then
        count <= count + 1;
      elsif wr_en = '0' and rd_en = '1' then
        count <= count - 1;
      end if;
      if move = '1' then
        o_data <= r_data;
      end if;
      r_v <= rd_en or (r_v and not move);
      o_v <= move or (o_v and not pop);
      if rst = '1' then
        wr_ptr <= (others => '0');
        rd_ptr <= (others => '0');
        count <= (others => '0');
        r_v <= '0';
        o_v <= '0';
      end if;
    end if;
  end process;

  out_data <= o_data;
  out_valid <= o_v;
end architecture;

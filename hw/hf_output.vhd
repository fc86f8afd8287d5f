-- Output processing: joins each frame in the packet FIFO with its decision, then drops it or sends it with
-- the decided TUSER (dst_port, and metadata when shunted). One beat per cycle; stalls only on m_axis_tready.
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_output is
  generic (
    DATA_WIDTH  : positive := 256;  -- TDATA bits
    TUSER_WIDTH : positive := 128   -- TUSER bits
  );
  port (
    clk         : in  std_logic;
    rst         : in  std_logic;
    -- packet FIFO: tdata & tkeep & tlast
    p_data      : in  std_logic_vector(DATA_WIDTH - 1 downto 0);
    p_keep      : in  std_logic_vector(DATA_WIDTH / 8 - 1 downto 0);
    p_last      : in  std_logic;
    p_valid     : in  std_logic;
    p_ready     : out std_logic;
    -- decision FIFO
    d_drop      : in  std_logic;
    d_tuser     : in  std_logic_vector(TUSER_WIDTH - 1 downto 0);
    d_events    : in  std_logic_vector(EV_W - 1 downto 0);
    d_valid     : in  std_logic;
    d_ready     : out std_logic;
    m_axis_tdata  : out std_logic_vector(DATA_WIDTH - 1 downto 0);
    m_axis_tkeep  : out std_logic_vector(DATA_WIDTH / 8 - 1 downto 0);
    m_axis_tuser  : out std_logic_vector(TUSER_WIDTH - 1 downto 0);
    m_axis_tvalid : out std_logic;
    m_axis_tready : in  std_logic;
    m_axis_tlast  : out std_logic;
    -- one pulse per frame when its decision is taken (counters)
    ev_valid    : out std_logic;
    ev_bits     : out std_logic_vector(EV_W - 1 downto 0);
    ev_sent     : out std_logic
  );
end entity;

architecture rtl of hf_output is
  signal sop : std_logic := '1';  -- the next beat starts a frame
  signal cur_drop : std_logic := '0';
  signal cur_tuser : std_logic_vector(TUSER_WIDTH - 1 downto 0) := (others => '0');
  signal go, drop_now, beat_pop, dec_pop : std_logic;
begin
  go <= p_valid and (not sop or d_valid);
  drop_now <= d_drop when sop = '1' else cur_drop;
  beat_pop <= go and (drop_now or m_axis_tready);
  dec_pop <= beat_pop and sop;

  m_axis_tvalid <= go and not drop_now;
  m_axis_tdata <= p_data;
  m_axis_tkeep <= p_keep;
  m_axis_tlast <= p_last;
  m_axis_tuser <= d_tuser when sop = '1' else cur_tuser;
  p_ready <= beat_pop;
  d_ready <= dec_pop;

  ev_valid <= dec_pop;
  ev_bits <= d_events;
  ev_sent <= dec_pop and not d_drop;

  track : process (clk)
  begin
    if rising_edge(clk) then
      if beat_pop = '1' then
        sop <= p_last;
        if sop = '1' then
          cur_drop <= d_drop;
          cur_tuser <= d_tuser;
        end if;
      end if;
      if rst = '1' then
        sop <= '1';
      end if;
    end if;
  end process;
end architecture;

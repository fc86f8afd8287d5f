-- Pipelined priority encoder: index of the lowest set bit of a wide vector, one vector per cycle.
-- Each stage reduces groups of FANIN (valid, index) pairs to one, so N_IN = 10,000 at FANIN 8 takes 5 stages.
-- The stage count is computed once, by hypafilter.hw.vhdl.enc_stages, and given here as STAGES (checked below).
library ieee;
use ieee.std_logic_1164.all;
use ieee.numeric_std.all;

use work.hf_pkg.all;

entity hf_prio_enc is
  generic (
    N_IN   : positive := 64;  -- input bits (bit 0 has the highest priority)
    FANIN  : positive := 8;   -- inputs per group and stage (a power of two >= 2)
    STAGES : positive := 2;   -- pipeline stages: the least s with FANIN ** s >= N_IN (enc_stages in Python)
    IDX_W  : positive := 6    -- bits of the index output (at least clog2(N_IN))
  );
  port (
    clk     : in  std_logic;
    vec     : in  std_logic_vector(N_IN - 1 downto 0);
    any     : out std_logic;  -- some bit was set (STAGES cycles after vec)
    idx     : out unsigned(IDX_W - 1 downto 0)
  );
end entity;

architecture rtl of hf_prio_enc is
  -- the tree's width, FANIN ** STAGES, once STAGES is known to fit N_IN: a declaration, so that a wrong STAGES
  -- stops elaboration here with its reason, before any signal is sized by it
  function tree_width(n, f, s : positive) return positive is
  begin
    assert n <= f ** s and (s = 1 or n > f ** (s - 1))
      report "hf_prio_enc: STAGES is not the least s with FANIN ** s >= N_IN" severity failure;
    return f ** s;
  end function;

  constant LF : natural := clog2(FANIN);
  constant WIDE : natural := tree_width(N_IN, FANIN, STAGES);  -- input padded to a full tree
  type idx_arr is array (0 to WIDE - 1) of unsigned(IDX_W - 1 downto 0);
  type any_stages is array (0 to STAGES) of std_logic_vector(WIDE - 1 downto 0);
  type idx_stages is array (1 to STAGES) of idx_arr;
  -- no initial values: GHDL writes them as one Verilog literal per signal, which grows past what yosys can read
  signal a : any_stages;
  signal x : idx_stages;
begin
  assert 2 ** LF = FANIN and FANIN >= 2 report "hf_prio_enc: FANIN must be a power of two >= 2" severity failure;
  assert 2 ** IDX_W >= N_IN report "hf_prio_enc: IDX_W too small for N_IN" severity failure;
  assert LF * STAGES <= 31 report "hf_prio_enc: tree too deep" severity failure;

  a(0)(N_IN - 1 downto 0) <= vec;
  pad : if WIDE > N_IN generate
    a(0)(WIDE - 1 downto N_IN) <= (others => '0');
  end generate;

  stage : for s in 1 to STAGES generate
    constant GROUPS : natural := WIDE / FANIN ** s;
  begin
    reduce : process (clk)
      variable found : std_logic;
      variable sel : unsigned(IDX_W - 1 downto 0);
    begin
      if rising_edge(clk) then
        -- groups past this stage's width stay zero (and are trimmed): nothing is left undriven
        for g in GROUPS to WIDE - 1 loop
          a(s)(g) <= '0';
          x(s)(g) <= (others => '0');
        end loop;
        for g in 0 to GROUPS - 1 loop
          found := '0';
          sel := (others => '0');
          for j in FANIN - 1 downto 0 loop
            if a(s - 1)(g * FANIN + j) = '1' then
              found := '1';
              if s = 1 then
                sel := to_unsigned(j, IDX_W);
              else
                sel := shift_left(to_unsigned(j, IDX_W), LF * (s - 1)) or x(s - 1)(g * FANIN + j);
              end if;
            end if;
          end loop;
          a(s)(g) <= found;
          x(s)(g) <= sel;
        end loop;
      end if;
    end process;
  end generate;

  any <= a(STAGES)(0);
  idx <= x(STAGES)(0);
end architecture;

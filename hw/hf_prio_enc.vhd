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
  -- Stage s keeps only its ceil(N_IN / FANIN ** s) live groups: no padding to a full FANIN ** STAGES tree, so the
  -- registers are as wide as the logic (a padded tree re-assigned ~30x as many constant bits every clock, which
  -- dominated simulation time at 1,100 entries and beyond). All stages share one flat vector, stage s at
  -- [off(s), off(s) + groups(s)), driven by one process: one register per live group and nothing else.
  function groups(n, f, s : positive) return positive is
    variable w : positive := n;
  begin
    for k in 1 to s loop
      w := (w + f - 1) / f;
    end loop;
    return w;
  end function;

  function off(n, f, s : positive) return natural is
    variable o : natural := 0;
  begin
    for k in 1 to s - 1 loop
      o := o + groups(n, f, k);
    end loop;
    return o;
  end function;

  -- the flat vector's width, once STAGES is known to fit N_IN: a declaration, so that a wrong STAGES stops
  -- elaboration here with its reason, before any signal is sized by it
  function total_width(n, f, s : positive) return positive is
  begin
    assert n <= f ** s and (s = 1 or n > f ** (s - 1))
      report "hf_prio_enc: STAGES is not the least s with FANIN ** s >= N_IN" severity failure;
    return off(n, f, s) + groups(n, f, s);
  end function;

  constant LF : natural := clog2(FANIN);
  constant TOT : positive := total_width(N_IN, FANIN, STAGES);
  type idx_arr is array (0 to TOT - 1) of unsigned(IDX_W - 1 downto 0);
  -- no initial values: GHDL writes them as one Verilog literal per signal, which grows past what yosys can read
  signal a : std_logic_vector(TOT - 1 downto 0);
  signal x : idx_arr;
begin
  assert 2 ** LF = FANIN and FANIN >= 2 report "hf_prio_enc: FANIN must be a power of two >= 2" severity failure;
  assert 2 ** IDX_W >= N_IN report "hf_prio_enc: IDX_W too small for N_IN" severity failure;
  assert LF * STAGES <= 31 report "hf_prio_enc: tree too deep" severity failure;

  reduce : process (clk)
    variable found : std_logic;
    variable sel : unsigned(IDX_W - 1 downto 0);
    variable n_prev, o_prev, o_cur : natural;
  begin
    if rising_edge(clk) then
      for s in 1 to STAGES loop
        n_prev := N_IN;
        o_prev := 0;
        if s > 1 then
          n_prev := groups(N_IN, FANIN, s - 1);
          o_prev := off(N_IN, FANIN, s - 1);
        end if;
        o_cur := off(N_IN, FANIN, s);
        for g in 0 to groups(N_IN, FANIN, s) - 1 loop
          found := '0';
          sel := (others => '0');
          for j in FANIN - 1 downto 0 loop
            if g * FANIN + j < n_prev then  -- inputs past the previous stage's width do not exist
              if s = 1 then
                if vec(g * FANIN + j) = '1' then
                  found := '1';
                  sel := to_unsigned(j, IDX_W);
                end if;
              elsif a(o_prev + g * FANIN + j) = '1' then
                found := '1';
                sel := shift_left(to_unsigned(j, IDX_W), LF * (s - 1)) or x(o_prev + g * FANIN + j);
              end if;
            end if;
          end loop;
          a(o_cur + g) <= found;
          x(o_cur + g) <= sel;
        end loop;
      end loop;
    end if;
  end process;

  any <= a(TOT - 1);
  idx <= x(TOT - 1);
end architecture;

"""The seeded GHDL build of sim.hftb (ghdl_build): a build folder that starts from another build's library
re-analyses the generated file whose content differs, and what depends on it, and nothing else."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import need_tool
from sim.hftb import SIM_BUILD, fresh_build, ghdl_build, hw

TOP = "seed_top"
ARGS = ["--std=08"]


def _build(folder: Path, k: int, capfd) -> tuple[str, str]:
    """Write gen/k_pkg.vhd (constant K = k) and gen/seed_top.vhd (reports K, reads hf_pkg), build them with the
    static hw/hf_pkg.vhd; returns (the build's output, what the elaborated top level reports)."""
    gen = folder / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    (gen / "k_pkg.vhd").write_text(f"package k_pkg is constant K : integer := {k}; end package;\n")
    (gen / "seed_top.vhd").write_text(
        "library ieee; use ieee.std_logic_1164.all; use work.hf_pkg.all; use work.k_pkg.all;\n"
        "entity seed_top is end entity;\n"
        "architecture a of seed_top is begin\n"
        '  process begin report "K=" & integer\'image(K) & " W=" & integer\'image(clog2(1000)); wait; end process;\n'
        "end architecture;\n"
    )
    capfd.readouterr()
    ghdl_build(TOP, [*hw("hf_pkg.vhd"), gen / "k_pkg.vhd", gen / "seed_top.vhd"], folder, ARGS)
    built = capfd.readouterr().out
    run = subprocess.run(["ghdl", "-r", "--work=top", *ARGS, TOP], cwd=folder, capture_output=True, text=True)
    return built, run.stdout + run.stderr


@pytest.mark.sim
def test_seeded_build_reanalyses_what_changed(capfd):
    """Three builds of one key: the first publishes a seed if none is there; the others start from a seed built
    with another K and must report their own, having analysed the changed package and its user only."""
    need_tool("ghdl")
    reanalysed = 0
    for n, k in enumerate((1, 2, 1)):
        built, ran = _build(fresh_build(TOP, f"k{n}"), k, capfd)
        assert f"K={k} W=10" in ran, ran
        if n:  # a seed exists now (built with K=1 or, from an earlier session, either value)
            assert "ghdl -i" not in built, "a seeded build imports nothing"
            assert "hf_pkg.vhd" not in built.split("ghdl -m", 1)[1], "the unchanged static file was re-analysed"
            reanalysed += "analyze gen/k_pkg.vhd" in built and "analyze gen/seed_top.vhd" in built
    assert reanalysed >= 1, "K changed from the seed's at least once: the package and its user are analysed again"
    assert any((SIM_BUILD / ".seeds").iterdir())

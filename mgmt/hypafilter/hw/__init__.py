"""The hardware artifacts of a Plan: VHDL generation, the register map, the bit-exact hardware model, synthesis."""

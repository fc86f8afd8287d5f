"""The analysis of an IR policy: header-space geometry, the Plan (entries, shunt vector, intervals), the software
chain program with its interpreter, and the Python emulation of the whole hybrid."""

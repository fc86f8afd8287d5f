"""The rule IR: boxes and their algebra, rules, policies and the meaning of a rule (what a first-match walk does).
Format-free: nothing here reads or writes iptables, nft or VHDL."""

"""The iptables front end and writer: tokenizer, option tables, rule parser, document reader, chain flattening,
canonical form and the one iptables-restore writer. It produces the rule IR and knows nothing of the analysis."""

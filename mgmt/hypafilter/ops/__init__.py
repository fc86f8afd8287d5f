"""Operations on a running system: the deploy transaction and its state, the kernel-oracle verifier, the lab."""

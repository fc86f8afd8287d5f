"""Operations on a running system: the deploy transaction and its state, the services a deployment runs (the flow
sync service) on a generic service runner and netlink layer, the kernel-oracle verifier, the lab."""

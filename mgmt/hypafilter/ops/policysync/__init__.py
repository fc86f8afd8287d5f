"""The policy sync service (ARCHITECTURE §2, "the policy is the kernel's live ruleset"; docs/deploy.md "Live policy"):
after deploy the operator's chains stay in the kernel under their names, and fail2ban, ufw, Docker, firewalld and
`iptables` keep editing them. The service follows nf_tables' change events in the firewall's namespace and brings
the fast path into step: on a change that may affect a verdict it first makes the fast path stop deciding (shunt
everything, every tag stale: the live rules decide every frame), then reads the live ruleset, applies it as an
update (through the update buffer when the running matcher can hold it) and resumes.

`nftevents` (the nf_tables event codec on ops.netlink), `live` (the live ruleset as a Policy), `service` (the
worker loop and its place among the deployment's services, ops.daemon / ops.services)."""

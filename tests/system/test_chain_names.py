"""User chains of any legal name and length load into the kernel in every strategy (ufw and firewalld use names of
25-28 characters; the tool's copies must still fit iptables' limit and collide with nothing)."""

from __future__ import annotations

import pytest
from hypafilter import netns

from tests.irbuild import CHAIN_NAMES, chain_names_policy_text
from tests.scratchns import scratch_netns

pytestmark = pytest.mark.system


@pytest.mark.parametrize("mode", ["index", "selective", "exact"])
def test_long_and_clashing_user_chain_names_load(mode):
    from hypafilter.analysis.plan import build_plan
    from hypafilter.analysis.program import STRATEGIES, user_chain_names
    from hypafilter.iptables.document import parse_policy
    from hypafilter.netfilter.restore import to_iptables_restore

    pol = parse_policy(chain_names_policy_text(), "names.rules")
    copies = user_chain_names("HF65535_", CHAIN_NAMES)
    with scratch_netns("hfcn", "iptables-restore", "iptables-save") as ns:
        for strategy in STRATEGIES:
            if strategy == "hsa_cut" and mode == "index":
                continue
            plan = build_plan(pol, mode=mode, strategy=strategy)  # log mirroring depends on the strategy
            netns.run(["iptables-restore"], ns, input=to_iptables_restore(plan, strategy, prefix="HF65535_"))
            saved = netns.run(["iptables-save", "-t", "filter"], ns).splitlines()
            for i, name in enumerate(CHAIN_NAMES):  # the kernel holds each user chain under the tool's name for it
                assert f'-A {copies[name]} -m string --string "x{i}" --algo bm -j DROP' in saved, (strategy, name)

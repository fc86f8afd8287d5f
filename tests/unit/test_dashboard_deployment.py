"""Dashboard: the deployment as re-planned from the deploy state, and netfilter counters mapped back to policy rules."""

import re

import pytest
from hypafilter.analysis.plan import build_plan
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.iptables.writer import policy_restore
from hypafilter.netfilter.restore import to_iptables_restore
from hypafilter.ops.deploy import partition_counts
from hypafilter.tools.dashboard.collector import attribute_netfilter, deployment_from_state, parse_iptables_save

USERCHAINS = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:WEB - [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -s 10.0.1.0/24 -p udp --dport 53 -j ACCEPT
-A FORWARD -p tcp -m string --string "BAD" --algo bm -j DROP
-A FORWARD -p tcp --dport 80 -j WEB
-A FORWARD -p udp --dport 5000:5100 -j DROP
-A FORWARD -p icmp -j ACCEPT
-A WEB -s 10.0.9.0/24 -j RETURN
-A WEB -d 10.0.2.0/24 -j ACCEPT
-A WEB -j LOG --log-prefix "web "
COMMIT
"""

FLAT = """-P FORWARD ACCEPT
-A FORWARD -p udp --dport 53 -j ACCEPT
-A FORWARD -s 10.0.3.0/24 -j DROP
-A FORWARD -p tcp -m string --string "BAD" --algo bm -j DROP
-A FORWARD -p tcp --dport 22 -j DROP
-A FORWARD -p icmp -j ACCEPT
"""


def deployed(tmp_path, text, strategy="interval", mode="selective", generation=4):
    """The state `hypafilter deploy` writes for `text` (the fields the dashboard reads), and the rendered chains."""
    path = tmp_path / "policy.rules"
    path.write_text(text)
    config = Config(strategy=strategy, shunt_mode=mode)
    policy = parse_policy(text, str(path), "FORWARD", config)
    plan = build_plan(policy, config)
    prefix = f"HF{generation}_"
    state = {
        "generation": generation,
        "prefix": prefix,
        "chain_prefix": "HF",
        "policy_hash": policy.policy_hash(),
        "policy_source": str(path),
        "base_chain": "FORWARD",
        "table": "filter",
        "mode": mode,
        "strategy": strategy,
        "mark_mask": config.mark_mask,
        "mark_shift": config.mark_shift,
        "plain_rules": policy_restore(policy),
        "partition": partition_counts(policy, plan),
        "nic": {"socket": "/run/hypafilter/x.sock"},
        "shim": {"netns": "hf-fw"},
        "history": [{"time": 10.0, "generation": generation, "kind": "deploy", "result": "ok", "duration_s": 1.5}],
    }
    return state, policy, plan, to_iptables_restore(plan, strategy, prefix)


def with_counters(restore_text):
    """The rendered chains as `iptables-save -c` would print them, each line counting a distinct packet number."""
    out, numbers = [], {}
    for n, line in enumerate(restore_text.splitlines(), 1):
        if line.startswith("-A "):
            out.append(f"[{n}:{n * 100}] {line}")
            numbers[line] = n
        else:
            out.append(line)
    return "\n".join(out) + "\n", numbers


def test_rules_entries_and_shunt_bits_follow_the_plan(tmp_path):
    state, policy, plan, _ = deployed(tmp_path, USERCHAINS)
    dep = deployment_from_state(state)
    assert dep.generation == 4 and dep.prefix == "HF4_" and dep.default == "DROP" and dep.nic.endswith("x.sock")
    assert len(dep.rules) == len(policy.rules) and dep.n_entries == len(plan.entries)
    for e, entry in enumerate(plan.entries):
        rule = dep.rules[entry.rule_index]
        assert rule.entry == e and rule.shunt == bool(plan.may_shunt[e])
    assert [r.simple for r in dep.rules] == [r.is_simple for r in policy.rules]
    assert dep.rules[4].where.endswith("policy.rules:13") and "10.0.2.0/24" in dep.rules[4].text
    assert dep.policy_shunt == bool(plan.may_shunt[len(plan.entries)])
    assert not dep.rules[0].shunt and dep.rules[2].shunt  # the hit part (never a miss) does not shunt; DNS may
    assert dep.partition["complex"] == len(policy.complex_indices)
    assert dep.history[0].duration == 1.5


def test_netfilter_counters_land_on_the_rule_each_line_was_emitted_for(tmp_path):
    state, _, _, text = deployed(tmp_path, USERCHAINS)
    dep = deployment_from_state(state)
    saved, numbers = with_counters(text)
    per_rule, _ = attribute_netfilter(parse_iptables_save(saved), dep.prefix, len(dep.rules), dep.positions)

    def line(pattern):
        hits = [n for ln, n in numbers.items() if re.search(pattern, ln)]
        assert len(hits) == 1, (pattern, hits)
        return hits[0]

    # conntrack's miss part (rule 1; its hit part, rule 0, is a hardware entry no frame leaves on a miss) sits in
    # C2, the string match (rule 3) in C3; the LOG rule of the user chain (rule 5) is counted by the last line of
    # its helper chain, not by the jump into it.
    assert per_rule[1][0] == line(r"^-A HF4_C2 .*conntrack")
    assert per_rule[3][0] == line(r"^-A HF4_C3 .*string")
    assert per_rule[5][0] == line(r"^-A HF4_R5L2 .*LOG")
    assert set(per_rule) == {1, 3, 5}


@pytest.mark.parametrize("strategy", ["full", "cut", "interval"])
def test_full_chain_maps_line_by_line_and_recounted_rules_do_not_add_hardware_hits(tmp_path, strategy):
    state, policy, plan, text = deployed(tmp_path, FLAT, strategy=strategy)
    dep = deployment_from_state(state)
    saved, numbers = with_counters(text)
    per_rule, _ = attribute_netfilter(parse_iptables_save(saved), dep.prefix, len(dep.rules), dep.positions)
    full = [n for ln, n in numbers.items() if ln.startswith("-A HF4_FULL ")]
    assert len(full) == len(policy.rules)
    for i in range(len(policy.rules)):
        assert per_rule[i][0] >= full[i]  # the k = 0 path counts for every rule
    shunting = [r for r in dep.rules if r.shunt]
    assert shunting, "the string rule above makes later simple rules shunt"
    for r in shunting:
        # full/cut evaluate shunted simple rules again in software; interval decides them by the mark's action.
        assert r.counts_hw == (strategy == "interval")
    assert all(r.counts_hw for r in dep.rules if r.simple and not r.shunt)


def test_a_changed_policy_file_falls_back_to_the_deployed_rules(tmp_path):
    state, policy, _, _ = deployed(tmp_path, FLAT)
    (tmp_path / "policy.rules").write_text(FLAT.replace("22", "23"))
    dep = deployment_from_state(state)
    assert [r.target for r in dep.rules] == [r.target for r in policy.rules]
    assert "as deployed" in dep.rules[0].where
    state["plain_rules"] = state["plain_rules"].replace("10.0.3.0/24", "10.0.4.0/24")
    with pytest.raises(HypafilterError, match="do not hash"):
        deployment_from_state(state)


def test_rule_ids_survive_rules_inserted_above(tmp_path):
    """The rule label is the rule, not its position: inserting rules above keeps every id; a duplicate line in
    the same chain gets its own id; the same line in another chain is another rule."""
    before = deployment_from_state(deployed(tmp_path, USERCHAINS)[0])
    lines = USERCHAINS.splitlines()
    at = lines.index("-A FORWARD -s 10.0.1.0/24 -p udp --dport 53 -j ACCEPT")
    lines[at:at] = ["-A FORWARD -p udp --dport 123 -j ACCEPT", "-A FORWARD -p tcp --dport 80 -j WEB"]
    (tmp_path / "v2").mkdir()
    after = deployment_from_state(deployed(tmp_path / "v2", "\n".join(lines) + "\n", generation=5)[0])
    old = {r.index: r.id for r in before.rules}
    assert len({r.id for r in after.rules}) == len(after.rules)
    ids_after = [r.id for r in after.rules]
    for r in before.rules:
        assert r.id in ids_after, r
    moved = [r for r in after.rules if r.id in old.values()]
    assert len(moved) == len(before.rules)
    # By position, index 2 would now name the inserted rule; by id, the DNS rule is found where it moved (the
    # conntrack rule above it is two rules, its hit and miss parts, with ids of their own).
    assert before.rules[0].id != before.rules[1].id
    assert after.rules[2].id != before.rules[2].id
    assert next(r for r in after.rules if r.id == before.rules[2].id).index == 5  # + udp 123 + WEB (2 rules)
    # The WEB rules reached through the inserted jump are new flattened rules, with their own ids.
    web = [r for r in after.rules if r.chain == "WEB"]
    assert len(web) == 2 * len([r for r in before.rules if r.chain == "WEB"])
    assert all(r.where for r in after.rules)


def test_an_empty_policy_deployed_with_allow_empty_is_shown(tmp_path):
    """A deployment made with --allow-empty (no rules: the chain policy decides) is re-read without an error."""
    path = tmp_path / "empty.rules"
    path.write_text("*filter\n:FORWARD DROP [0:0]\nCOMMIT\n")
    config = Config()
    policy = parse_policy(path.read_text(), str(path), "FORWARD", config, allow_empty=True)
    plan = build_plan(policy, config)
    state = {
        "generation": 2,
        "policy_hash": policy.policy_hash(),
        "policy_source": str(path),
        "plain_rules": policy_restore(policy),
        "partition": partition_counts(policy, plan),
    }
    dep = deployment_from_state(state)
    assert dep.rules == () and dep.default == "DROP" and dep.n_entries == len(plan.entries)
    path.unlink()  # from the state's copy of the rules too
    assert deployment_from_state(state).default == "DROP"

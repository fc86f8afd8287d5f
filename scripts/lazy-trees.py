#!/usr/bin/env python3
"""Strategy tree's interval chains, lazily rebuilt (docs/optimize.md, "Lazy trees"): what one change costs a follow.

The change: a string-match DROP inserted at the top of the operator's chain (`--ban`: dense, UDP from the set's
most common /16, which many of its rules meet; sparse, from an address none of them meets).

The policy: a ClassBench set (acl1_1100 by default) as a FORWARD policy with --complex string-match rules ahead of it
on the headers of every --stride-th rule (4), so that every shunted frame's interval chain is those rules, written as one tree.

Default (no root): the program a follow builds (analysis.program.build_program, which writes the trees) for the
policy with one complex rule inserted, the trees built anew (`fresh`: what every follow did before the interval
chains' trees were lazy) and kept with the change diverted ahead of them (`lazy`: a follow); `--repeats` runs each,
medians. With PYTHONPATH at an older tree's mgmt/, `lazy` is that version's follow.

`--live` (root, the xdp lab LAB): the policy deployed with strategy tree, then `--repeats` times the real iptables
inserts one complex rule in the operator's chain and deletes it again; for each change the policy sync service's
follow as the deployment's history records it: `applied_s` (the change read -> the new policy holds), `render_s`
(the step that builds and writes the chains), the tool's rules loaded and its tree chains' rules (those whose text
changed: `tree_rules_rewritten`, the generation's prefix taken out); `--verify N`: then `verify --live` with N
frames (30 % malformed) through the hybrid and the live ruleset alone, its mismatches. Run it with PYTHONPATH pointing at
another tree's mgmt/ to measure that version (the script uses only the CLI and the state file). One JSON line per
stage or change, then the medians of the changes after the first (which builds the bases' trees in the service's
new process).

    PYTHONPATH=mgmt .venv/bin/python scripts/lazy-trees.py [--complex N] [--stride S] [--ban dense|sparse] [--repeats R]
    PYTHONPATH=mgmt .venv/bin/python scripts/lazy-trees.py --live [--lab h3m] [--complex N] [--repeats R] [--verify N]

`--ipv6` (with --loaded or --live): the policy and the change moved into IPv6 as the IPv6 side of a dual-stack
deployment (rulesets/example.rules its IPv4 side): what a follow of ip6tables loads (docs/optimize.md "What a follow
loads").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data" / "classbench"


def ban(text: str, i: int, where: str = "dense") -> str:
    """The change, the options after `-A FORWARD`: a string-match DROP for UDP from the i-th most common /16 of the
    set's sources (`dense`: frames drawn from the policy meet it, and so do many of its rules, which its diversion
    holds), or from 10.250.i.0/24, which no rule of the set meets (`sparse`: the diversion holds the new rule)."""
    if where == "sparse":
        return f"-s 10.250.{i}.0/24 -p udp -m string --string HFLAZY{i} --algo bm -j DROP"
    nets = Counter(
        ".".join(m.group(1).split(".")[:2])
        for ln in text.splitlines()
        for m in [re.search(r"-A FORWARD -s (\S+)/", ln)]
        if m
    )
    net = [n for n, _ in nets.most_common()][i % len(nets)]
    return f"-s {net}.0.0/16 -p udp -m string --string HFLAZY{i} --algo bm -j DROP"


def policy_text(filters: str, n_complex: int, stride: int = 4) -> str:
    from hypafilter.tools.classbench import classbench_policy_text

    text = classbench_policy_text(filters, policy="DROP", actions="alternate")
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    rules = [ln for ln in lines if ln.startswith("-A FORWARD")]
    cx = [
        f"{r.rsplit(' -j ', 1)[0]} -m string --string BAD{j % 5} --algo bm -j {('DROP', 'ACCEPT')[j % 2]}"
        for j, r in enumerate(rules[::stride][:n_complex])
    ]
    return "\n".join(lines[:first] + cx + lines[first:]) + "\n"


def as_ipv6(text: str) -> str:
    """The policy (or a rule) with every IPv4 address and prefix moved into 2001:db8::/32 at the same place of its
    last 32 bits (a /p becomes a /96+p), as an ip6tables policy: the same rules, the same overlaps."""
    import ipaddress

    def six(m: re.Match) -> str:
        net = ipaddress.IPv4Network(m.group(0), strict=False)
        v6 = ipaddress.IPv6Network((0x20010DB8 << 96 | int(net.network_address), 96 + net.prefixlen))
        return str(v6)

    out = re.sub(r"\b\d+\.\d+\.\d+\.\d+/\d+\b", six, text)
    return out.replace(":FORWARD DROP [0:0]", ":INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]")


def loaded6(text: str, where: str) -> None:
    """`--loaded --ipv6`: the tool's IPv6 rules a follow of ip6tables loads (no root), the policy and the change moved
    into IPv6 (`as_ipv6`) as the IPv6 side of a dual-stack deployment (rulesets/example.rules its IPv4 side, the xdp
    program deciding both, strategy tree): the deployment's chains in ip6tables (trees built), then the change's
    follow with the trees kept and the change diverted (`lazy`, what the service does) and with every tree built
    anew (`rebuilt`), each loaded as ops.deploy._load_chains6 loads it (ops.ruleset.reuse_chains). `rules_all`: every
    chain of the follow, what a follow of ip6tables loaded before."""
    import dataclasses

    from hypafilter.analysis import trees
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.netfilter import ip6
    from hypafilter.ops.ruleset import reuse_chains
    from hypafilter.targets.xdp.v6 import plan6_for

    cfg = Config(strategy="tree", xdp_ipv6=True, nic_mode="bridge")
    v4 = (ROOT / "rulesets" / "example.rules").read_text()
    plan4 = build_plan(parse_policy(v4, filename="example.rules", base_chain="FORWARD", config=cfg), cfg, live=True)
    plan4.k0_tree = True
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    changed = "\n".join(lines[:first] + ["-A FORWARD " + ban(text, 1, where)] + lines[first:]) + "\n"

    def chains(t: str, gen: int | None, fresh: bool) -> tuple[list[str], float, dict]:
        t0 = time.monotonic()
        t6 = as_ipv6(t)
        ir = parse_policy(t6, "p6.rules", base_chain="FORWARD", config=cfg, family=6)
        v6 = dataclasses.replace(ip6.parse(t6, "p6.rules", "FORWARD", validate=False), ir=ir, tables=("filter",))
        plan6, why = plan6_for(v6, cfg, plan4, k_base=plan4.num_intervals)
        if why:
            raise SystemExit(why)
        plan6.trees_fresh = fresh
        c6 = ip6.render_chains(plan6, cfg, "HFv6_", gen)
        return ip6.body_lines(c6), time.monotonic() - t0, plan6.tree_stats

    for how, fresh in (("lazy", False), ("rebuilt", True)):
        trees._POOLS.clear()
        dep, _, _ = chains(text, None, True)  # the deployment's trees: this process's bases
        kernel = reuse_chains(dep, "HFv6_MAIN", {}).in_use
        new, s, stats = chains(changed, 2, fresh)
        r = reuse_chains(new, "HFv6_MAIN", kernel)
        row = {"family": 6, "follow": how, "change": where, "rules_all": sum(ln.startswith("-A ") for ln in new)}
        row.update(
            rules_loaded=r.rules_loaded, chains_loaded=len(r.created), chains_kept=len(r.kept), build_s=round(s, 3)
        )
        row.update({k: stats.get(k) for k in ("lazy_trees", "lazy_changed", "k0_tree", "k0_changed", "trees_built")})
        print(json.dumps(row), flush=True)


def in_process(text: str, repeats: int, where: str) -> None:
    from hypafilter.analysis.plan import build_plan
    from hypafilter.analysis.program import build_program
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy

    cfg = Config(strategy="tree")
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    changed = "\n".join(lines[:first] + ["-A FORWARD " + ban(text, 1, where)] + lines[first:]) + "\n"

    from hypafilter.analysis import trees

    def build(t: str, fresh: bool, recorded=None, cache=None) -> tuple[float, dict, object]:
        plan = build_plan(parse_policy(t, filename="p", base_chain="FORWARD", config=cfg), cfg, live=True)
        plan.trees_fresh = plan.k0_fresh = fresh  # (k0_fresh: the name before the chains' trees were lazy)
        plan.k0_tree = True
        plan.tree_bases, plan.tree_cache = recorded, cache
        t0 = time.monotonic()
        prog = build_program(plan, "tree")
        return time.monotonic() - t0, prog.tree_stats, plan

    # lazy: a follow in the process that holds the trees; fresh: every tree built; first: the first follow in a new
    # process (the service after a deploy or a restart) with the bases the deployment recorded, and its tree cache
    # when this version keeps one (analysis.trees.cache_json; read and parsed within the time)
    out: dict[str, list[float]] = {"lazy": [], "fresh": [], "first": []}
    for _ in range(repeats):
        for how in out:
            _, _, dep = build(text, True)  # the deployment: the bases a follow starts from
            if how == "first":
                recorded = trees.bases_of_json(json.loads(json.dumps(dep.tree_bases_built)))
                kept = getattr(dep, "tree_cache_built", None)
                cache_text = json.dumps(kept) if kept is not None else None
                trees._POOLS.clear()
                cache = (lambda c=cache_text: trees.cache_of_json(json.loads(c))) if cache_text else None
                s, stats, _ = build(changed, False, recorded, cache)
            else:
                s, stats, _ = build(changed, how == "fresh")
            out[how].append(s)
            print(json.dumps({"build": how, "s": round(s, 3), **stats}), flush=True)
    print(json.dumps({k + "_median_s": round(statistics.median(v), 3) for k, v in out.items()}))


def loaded(text: str, where: str) -> None:
    """The tool's rules a follow loads (no root): the deployment's chains (trees built, generation 1), then the
    change's follow (generation 2) with the trees kept and the change diverted (`lazy`, what the service does) and
    with every tree built anew (`rebuilt`), each loaded as ops.deploy loads it: only the chains whose content the
    kernel does not hold (ops.ruleset.reuse_chains). `all`: the follow's chains, every one of which a follow loaded
    before (the load of the whole generation)."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.iptables.writer import body_of
    from hypafilter.netfilter.restore import to_iptables_restore
    from hypafilter.ops.ruleset import reuse_chains

    cfg = Config(strategy="tree")
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    changed = "\n".join(lines[:first] + ["-A FORWARD " + ban(text, 1, where)] + lines[first:]) + "\n"

    def body(t: str, gen: int, fresh: bool) -> tuple[list[str], dict]:
        plan = build_plan(parse_policy(t, filename="p", base_chain="FORWARD", config=cfg), cfg, live=True)
        plan.trees_fresh, plan.k0_tree = fresh, True
        out = body_of(to_iptables_restore(plan, "tree", f"HF{gen}_"))
        return out, plan.tree_stats

    dep, _ = body(text, 1, True)
    kernel = reuse_chains(dep, "HF1_MAIN", {}).in_use
    for how, fresh in (("lazy", False), ("rebuilt", True)):
        t0 = time.monotonic()
        new, stats = body(changed, 2, fresh)
        s = time.monotonic() - t0
        r = reuse_chains(new, "HF2_MAIN", kernel)
        row = {"follow": how, "change": where, "rules_all": sum(ln.startswith("-A ") for ln in new)}
        row.update(
            rules_loaded=r.rules_loaded, chains_loaded=len(r.created), chains_kept=len(r.kept), build_s=round(s, 3)
        )
        row.update({k: stats.get(k) for k in ("lazy_trees", "lazy_changed", "k0_tree", "k0_changed", "trees_built")})
        print(json.dumps(row), flush=True)


class LiveLab:
    """The bench's xdp lab `lab` (state in /run/hypafilter/<lab>-bench): hypafilter commands, commands in its
    firewall namespace, the deployment's history."""

    def __init__(self, lab: str):
        self.lab, self.state = lab, Path(f"/run/hypafilter/{lab}-bench")
        self.env = dict(os.environ, HF_LAB=lab, HF_STATE_DIR=str(self.state))
        self.cli = [sys.executable, "-m", "hypafilter"]

    def hf(self, *args: str) -> str:
        return subprocess.run([*self.cli, *args], env=self.env, check=True, capture_output=True, text=True).stdout

    def deploy(self, config: str, v4: str | None, v6: str | None = None) -> float:
        """The lab brought up afresh (xdp) and `v4` (None: rulesets/example.rules) deployed with `config` (TOML text),
        `v6` beside it (--ipv6) when given; the deploy's seconds."""
        self.hf("lab", "down", "--name", self.lab)
        self.hf("lab", "up", "--target", "xdp", "--name", self.lab)
        with tempfile.TemporaryDirectory() as tmp:
            cfg, pol = Path(tmp) / "tree.toml", Path(tmp) / "p.rules"
            cfg.write_text(config)
            argv = [str(ROOT / "rulesets" / "example.rules")]
            if v4 is not None:
                pol.write_text(v4)
                argv = [str(pol)]
            if v6 is not None:
                (Path(tmp) / "p6.rules").write_text(v6)
                argv += ["--ipv6", str(Path(tmp) / "p6.rules")]
            t0 = time.monotonic()
            self.hf("deploy", *argv, "--config", str(cfg), "-q")
            return time.monotonic() - t0

    def down(self) -> None:
        """Undeploy, the lab down, its state removed (whatever failed before)."""
        subprocess.run([*self.cli, "undeploy", "-q"], env=self.env, capture_output=True)
        subprocess.run([*self.cli, "lab", "down", "--name", self.lab], env=self.env, capture_output=True)
        shutil.rmtree(self.state, ignore_errors=True)

    def ns(self, *args: str) -> str:
        argv = ["ip", "netns", "exec", f"{self.lab}-fw", *args]
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout

    def history(self) -> list:
        try:
            return json.loads((self.state / "state.json").read_text()).get("history") or []
        except (OSError, ValueError):
            return []


def live(text: str, lab: str, repeats: int, where: str, verify: int = 0) -> None:
    lab_ = LiveLab(lab)
    state, ipt, history, hf, env = lab_.state, lab_.ns, lab_.history, lab_.cli, lab_.env

    loaded = [0]

    def trees() -> set[str]:
        # the tool's chains of every generation (a follow keeps unchanged chains under their earlier names), with the
        # generation's prefix taken out
        listing = ipt("iptables-save", "-t", "filter")
        loaded[0] = sum(bool(re.match(r"-A HF\d+_", ln)) for ln in listing.splitlines())
        return {re.sub(r"HF\d+_", "P_", ln) for ln in listing.splitlines() if re.match(r"-A HF\d+_T\d+ ", ln)}

    rows = []
    try:
        lab_.deploy('strategy = "tree"\ntarget = "xdp"\n', text)
        for i in range(repeats):
            for verb in ("-I", "-D"):
                before, seen = trees(), len(history())
                rule = ban(text, i, where).split()
                ipt("iptables", "-w", verb, "FORWARD", *(["2"] if verb == "-I" else []), *rule)
                deadline = time.monotonic() + 120
                while len(history()) <= seen or history()[-1].get("kind") != "follow":
                    if time.monotonic() > deadline:
                        raise SystemExit("the deployment did not follow within 120 s")
                    time.sleep(0.05)
                h = history()[-1]
                after = trees()
                st = json.loads((state / "state.json").read_text()).get("trees") or {}
                row = {
                    "change": f"iptables {verb}",
                    "applied_s": h.get("applied_s"),
                    "render_s": (h.get("steps") or {}).get("render"),
                    "netfilter_s": (h.get("steps") or {}).get("netfilter"),  # the load of the tool's chains
                    "duration_s": h.get("duration_s"),
                    "tool_rules": loaded[0],
                    # the rules the follow's load wrote (before it was recorded, every follow loaded all the tool's)
                    "rules_loaded": h.get("rules_loaded", loaded[0]),
                    "tree_rules": len(after),
                    "tree_rules_rewritten": len(after - before),
                    "trees_built": st.get("trees_built"),  # (None before the tree cache: not counted)
                }
                if verify:  # the hybrid against the live ruleset alone in the kernel, after this follow
                    p = subprocess.run(
                        hf + ["verify", "--live", "--packets", str(verify), "--malformed", "0.3", "--json"],
                        env=env,
                        capture_output=True,
                        text=True,
                    )
                    rep = json.loads(p.stdout) if p.stdout else {"mismatches": None, "error": p.stderr[-300:]}
                    row.update(verify_frames=rep.get("packets"), mismatches=rep.get("mismatches"))
                    counted = ipt("iptables-save", "-c", "-t", "filter")
                    row["diverted"] = sum(
                        int(m.group(1))
                        for ln in counted.splitlines()
                        if re.search(r"-A HF\d+_L\d+A\d+ .*-j HF\d+_TD\d+", ln)
                        for m in [re.match(r"\[(\d+):", ln)]
                    )
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        lab_.down()
    # the first follow runs in the service's new process (started by the deploy): it builds the bases' trees again
    # unless the deployment's tree cache holds them; reported apart from the medians of the follows after it
    later = rows[1:] or rows
    summary = {
        f"{k}_median_after_first": statistics.median(r[k] for r in later)
        for k in ("applied_s", "render_s", "rules_loaded")
    }
    if rows:
        summary.update({f"{k}_first": rows[0][k] for k in ("applied_s", "render_s", "trees_built")})
    print(json.dumps(summary))
    if verify and any(r.get("mismatches") != 0 for r in rows):
        raise SystemExit("verify --live found mismatches (or did not run): see the rows above")


def live6(text: str, lab: str, repeats: int, where: str, verify: int = 0) -> None:
    """`--live --ipv6` (root, the xdp lab LAB): rulesets/example.rules deployed with the policy as its IPv6 side
    (`as_ipv6`; xdp_ipv6, strategy tree), then `--repeats` times the real ip6tables inserts the change (moved into
    IPv6) in the operator's chain and deletes it; for each, the policy sync service's follow of ip6tables as the
    deployment's history records it (`duration_s`: deploy.follow6, the chains' load and the program's IPv6 tables),
    the tool's IPv6 rules it loaded (`rules_loaded`; a version that does not record it loaded every one: the tool's
    rules in ip6tables after it) and the tool's IPv6 rules; `--verify N`: then `verify --live` with N frames of each
    family, its IPv6 mismatches."""
    lab_ = LiveLab(lab)
    ns, history, hf, env = lab_.ns, lab_.history, lab_.cli, lab_.env

    rows = []
    try:
        took = lab_.deploy('strategy = "tree"\ntarget = "xdp"\nxdp_ipv6 = true\n', None, as_ipv6(text))
        print(json.dumps({"deploy_s": round(took, 2)}), flush=True)
        for i in range(repeats):
            for verb in ("-I", "-D"):
                seen = len(history())
                rule = as_ipv6(ban(text, i, where)).split()
                ns("ip6tables", "-w", verb, "FORWARD", *(["2"] if verb == "-I" else []), *rule)
                deadline = time.monotonic() + 120
                while not [h for h in history()[seen:] if h.get("kind") == "follow6"]:
                    if time.monotonic() > deadline:
                        raise SystemExit("the deployment did not follow ip6tables within 120 s")
                    time.sleep(0.05)
                h = [h for h in history()[seen:] if h.get("kind") == "follow6"][-1]
                tool = sum(ln.startswith("-A HFv6_") for ln in ns("ip6tables-save", "-t", "filter").splitlines())
                row = {
                    "change": f"ip6tables {verb}",
                    "how": h.get("how"),
                    "duration_s": h.get("duration_s"),
                    "tool_rules": tool,
                    "rules_loaded": h.get("rules_loaded", tool),
                    "chains_kept": h.get("chains_kept", 0),
                    "load6_s": h.get("load6_s"),  # the restore of the chains (not recorded before)
                    "trees_built": h.get("trees_built"),
                    "lazy_trees": h.get("lazy_trees"),
                }
                if verify:
                    p = subprocess.run(
                        hf + ["verify", "--live", "--packets", str(verify), "--json"],
                        env=env,
                        capture_output=True,
                        text=True,
                    )
                    rep = json.loads(p.stdout) if p.stdout else {"error": p.stderr[-300:]}
                    six = rep.get("ipv6") or {}
                    row.update(verify6_frames=six.get("packets"), mismatches6=six.get("mismatches"))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        lab_.down()
    if rows:
        print(
            json.dumps({f"{k}_median": statistics.median(r[k] for r in rows) for k in ("duration_s", "rules_loaded")})
        )
    if verify and any(r.get("mismatches6") != 0 for r in rows):
        raise SystemExit("verify --live found IPv6 mismatches (or did not run): see the rows above")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--filters", default=str(SHARED / "acl1_1100.filters"))
    ap.add_argument("--complex", type=int, default=256, help="complex rules ahead of the set (the chains' length)")
    ap.add_argument("--stride", type=int, default=4, help="the complex rules' headers: every STRIDE-th rule's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--live", action="store_true", help="follows of a deployment on the xdp lab (root)")
    ap.add_argument("--ban", choices=("dense", "sparse"), default="dense", help="where the change is (see ban)")
    ap.add_argument("--lab", default="h3m", help="the xdp lab's name (--live)")
    ap.add_argument("--verify", type=int, default=0, help="--live: verify --live with N frames after each follow")
    ap.add_argument("--loaded", action="store_true", help="the rules a follow loads, lazy and rebuilt (no root)")
    ap.add_argument("--ipv6", action="store_true", help="the policy and the change as the IPv6 side (as_ipv6)")
    a = ap.parse_args()
    text = policy_text(a.filters, a.complex, a.stride)
    if a.loaded and a.ipv6:
        loaded6(text, a.ban)
    elif a.live and a.ipv6:
        live6(text, a.lab, a.repeats, a.ban, a.verify)
    elif a.loaded:
        loaded(text, a.ban)
    elif a.live:
        live(text, a.lab, a.repeats, a.ban, a.verify)
    else:
        in_process(text, a.repeats, a.ban)


if __name__ == "__main__":
    main()

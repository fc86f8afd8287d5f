"""`hypafilter compile`: every artifact of a policy (partition, shunt vectors, netfilter per strategy, shim table,
register image, manifest) into one directory, written atomically (a temporary directory renamed at the end)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from hypafilter.analysis.plan import MODES, Plan, action_words, build_plan
from hypafilter.analysis.program import STRATEGIES
from hypafilter.cli.common import add_policy_args, load_config, load_policy, load_policy6
from hypafilter.config import MIRROR_STRATEGIES
from hypafilter.errors import HypafilterError
from hypafilter.hw.model import CONTROL_MISS_SHUNT, miss_shunt_control
from hypafilter.ir import Policy
from hypafilter.netfilter.nft import to_nft
from hypafilter.netfilter.restore import to_iptables_restore

ENTRY_LIMIT = 1 << 24  # match_index is 24 bits in the metadata


def register(sub) -> None:
    p = sub.add_parser("compile", help="compile a policy into hardware/software artifacts")
    add_policy_args(p, ipv6=True)
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="output directory (replaced atomically)")
    p.add_argument("--mode", choices=MODES, help="shunting mode (default: the configuration's shunt_mode)")
    p.add_argument("--prefix", help="netfilter chain prefix (default: <chain_prefix>1_)")
    p.set_defaults(func=run)


def register_image(plan: Plan) -> list[dict]:
    """Indirect-table writes (hw/regmap.txt): SHUNT packed 32 per word, ACTION one per entry (the action code, | 0x8
    HF_ACTION_MIRROR_BIT for a mirrored entry); for a plan with miss forcing, the CONTROL bits 4/5 too."""
    writes = []
    bits = plan.shunt
    for w in range((len(bits) + 31) // 32):
        word = 0
        for j, b in enumerate(bits[32 * w : 32 * w + 32]):
            word |= int(bool(b)) << j
        writes.append({"table": "SHUNT", "offset": w, "value": word})
    writes += [{"table": "ACTION", "offset": i, "value": a} for i, a in enumerate(action_words(plan))]
    if any(plan.miss_shunt):  # miss forcing: CONTROL bits 4/5 under their mask (the other bits are the site's)
        writes.append({"register": "CONTROL", "mask": CONTROL_MISS_SHUNT, "value": miss_shunt_control(plan.miss_shunt)})
    return writes


def partition_text(plan: Plan) -> str:
    rep = plan.report()
    lines = [
        f"policy {rep['source']} ({rep['base_chain']}, policy {rep['default']}), hash {rep['policy_hash'][:16]}",
        f"{rep['rules']} rules: {rep['simple']} simple, {rep['complex']} complex; mode {rep['mode']}, "
        f"{rep['entries']} hardware entries, {rep['shunting_entries']} shunting, policy entry "
        f"{'shunted' if rep['policy_entry_shunted'] else 'not shunted'}, {rep['intervals']} intervals",
        *(
            [
                f"miss forcing (CONTROL bits 4/5): frames the flow cache does not know are shunted when the verdict is "
                f"{' or '.join(v for v, on in zip(('ACCEPT', 'DROP'), plan.miss_shunt, strict=True) if on)}"
            ]
            if any(plan.miss_shunt)
            else []
        ),
        *(
            [
                f"log mirroring: {int(plan.observing.sum())} observing rules (kind 'observe'); {rep['mirroring_entries']} "
                f"entries{' and the policy entry' if rep['policy_entry_mirrored'] else ''} mirrored (shunt column 'm': "
                "decided in hardware, a copy runs the observing rules in software)"
            ]
            if plan.observing.any()
            else []
        ),
        "",
        f"{'#':>5} {'line':>5} {'kind':<8} {'entry':>6} {'shunt':>5} {'k':>5}  rule",
    ]
    for r in rep["partition"]:
        shunt = "" if r["shunt"] is None else "m" if r.get("mirror") else str(int(r["shunt"]))
        if r.get("observing"):
            r["kind"] = "observe"
        lines.append(
            f"{r['index']:>5} {r['line'] or '':>5} {r['kind']:<8} {'' if r['entry'] is None else r['entry']:>6} "
            f"{shunt:>5} {'' if r['interval'] is None else r['interval']:>5}  {r['text'] or r['target']}"
        )
    return "\n".join(lines) + "\n"


def compile_to(
    policy: Policy,
    config,
    out: Path,
    mode: str | None = None,
    prefix: str | None = None,
    dual_base: dict | None = None,
) -> dict:
    """Write every artifact to `out` (created or replaced only when everything succeeded); the manifest. An IPv6
    policy (Policy.family 6) is compiled on its address ranks (ir.family; addr_map.json holds them), its netfilter
    text is for ip6tables-restore (`.ip6tables`); `dual_base`: for the IPv6 side of a dual stack, where the contract
    (docs/ipv6.md) places its hardware indices and interval numbers after the IPv4 plan's (manifest "dual_stack")."""
    plan = build_plan(policy, config, mode)
    if plan.n + 1 > ENTRY_LIMIT:
        raise HypafilterError(f"{plan.n} hardware entries: more than the 24-bit match_index allows")
    prefix = prefix or f"{config.chain_prefix}1_"
    plans = {m: (plan if m == plan.mode else build_plan(policy, config, m)) for m in ("index", "selective")}
    files: dict[str, str] = {}
    files["partition.json"] = json.dumps(plan.report(), indent=1) + "\n"
    files["partition.txt"] = partition_text(plan)
    files["shunt.json"] = (
        json.dumps(
            {
                "mode": plan.mode,
                "vector": plan.shunt_string(),
                "index_based": plans["index"].shunt_string(),
                "selective": plans["selective"].shunt_string(),
            },
            indent=1,
        )
        + "\n"
    )
    mm, ms = config.mark_mask, config.mark_shift
    # The chains of the mode the policy would be deployed in (host mode: INPUT); a chain no NIC sees (OUTPUT)
    # still compiles, as in bridge mode.
    nic_mode = config.mode_for(policy.base_chain)
    skipped: dict[str, str] = {}
    for s in STRATEGIES:
        if plan.mirror.any() and s not in MIRROR_STRATEGIES:
            # these tables mirror observing rules; a copy must never meet this strategy's chains
            why = f'the plan mirrors observing rules (strategy {plan.strategy}); set strategy = "{s}" in the site configuration for these'
            skipped[f"netfilter/{s}.iptables"] = skipped[f"netfilter/{s}.nft"] = why
            continue
        ext = "ip6tables" if plan.family == 6 else "iptables"  # (an ip6tables-restore text for an IPv6 policy)
        try:
            files[f"netfilter/{s}.{ext}"] = to_iptables_restore(
                plan, s, prefix, mm, ms, table=config.table, nic_mode=nic_mode
            )
        except HypafilterError as e:
            if s != "hsa_cut":
                raise
            skipped[f"netfilter/{s}.{ext}"] = str(e)
            continue
        if plan.family == 6:
            # (the writer's ip6 form, its hotdrop guards tied to the loaded back end, serves bench rate's nft path)
            skipped[f"netfilter/{s}.nft"] = "no nft output for an IPv6 policy's strategies: use the .ip6tables file"
            continue
        try:
            files[f"netfilter/{s}.nft"] = to_nft(plan, s, prefix, mm, ms, nic_mode=nic_mode)
        except HypafilterError as e:
            skipped[f"netfilter/{s}.nft"] = str(e)
    files["shim_intervals.json"] = (
        json.dumps(
            {
                "num_entries": plan.n + 1,
                "mark_mask": mm,
                "mark_shift": ms,
                "intervals": [int(k) for k in plan.interval],
            }
        )
        + "\n"
    )
    files["registers.json"] = json.dumps(register_image(plan)) + "\n"
    if plan.addr_map is not None:  # an IPv6 plan: the rank space its entries' addresses are in (ir.family)
        files["addr_map.json"] = json.dumps({d: [hex(v) for v in s] for d, s in plan.addr_map.starts.items()}) + "\n"
    manifest = {
        "policy": policy.source,
        "policy_hash": plan.policy_hash,
        "mode": plan.mode,
        "prefix": prefix,
        "rules": len(policy.rules),
        "simple": len(policy.simple_indices),
        "complex": len(policy.complex_indices),
        "entries": plan.n,
        "shunting_entries": int(plan.shunt[:-1].sum()),
        "miss_shunt": {"accept": bool(plan.miss_shunt[0]), "drop": bool(plan.miss_shunt[1])},
        "intervals": plan.num_intervals,
        "files": sorted([*files, "manifest.json"]),
        "skipped": skipped,
    }
    if plan.family != 4:  # (only then: IPv4 manifests stay as they were)
        manifest["family"] = plan.family
        manifest["address_ranks"] = {d: len(s) for d, s in plan.addr_map.starts.items()}
        if dual_base is not None:
            manifest["dual_stack"] = dual_base
    files["manifest.json"] = json.dumps(manifest, indent=1) + "\n"
    out = Path(out)
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        for name, text in files.items():
            f = tmp / name
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=parent))
            os.rename(out, old / "d")
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def run(args: argparse.Namespace) -> int:
    config = load_config(args)
    policy = load_policy(args, config)
    policy6 = load_policy6(args, config)  # dual stack: the IPv6 side goes to OUTPUT/ipv6
    out = Path(args.output)
    if policy6 is None:
        _said(args.output, compile_to(policy, config, out, args.mode, args.prefix))
        return 0
    # The IPv6 side first, beside OUTPUT, then the IPv4 side, then the IPv6 side moved in: a failure on either side
    # leaves OUTPUT as it was.
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.v6.", dir=parent))
    try:
        m4 = _plan_sizes(policy, config, args.mode)
        # the IPv6 entries follow the IPv4 entries, the IPv4 policy entry and the update buffer's slots, as in the
        # dual-stack core (hw.vhdl.v6_base) and the xdp program (targets.xdp.v6.plan6_for)
        base = {"index_base": m4[0] + 1 + config.update_buffer, "k_base": m4[1]}
        m6 = compile_to(policy6, config, tmp / "ipv6", args.mode, args.prefix, dual_base=base)
        m = compile_to(policy, config, out, args.mode, args.prefix)
        os.rename(tmp / "ipv6", out / "ipv6")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _said(args.output, m)
    _said(str(out / "ipv6"), m6)
    return 0


def _plan_sizes(policy: Policy, config, mode: str | None) -> tuple[int, int]:
    """(entries, largest k) of the IPv4 plan compile_to builds."""
    plan = build_plan(policy, config, mode)
    return plan.n, plan.num_intervals


def _said(output: str, m: dict) -> None:
    fam = f", IPv{m['family']}" if m.get("family") else ""
    print(
        f"{output}: {m['rules']} rules ({m['simple']} simple, {m['complex']} complex){fam}, mode {m['mode']}, "
        f"{m['shunting_entries']} shunting entries, {m['intervals']} intervals, {len(m['files'])} files"
    )
    for f, why in m["skipped"].items():
        print(f"  skipped {f}: {why}")

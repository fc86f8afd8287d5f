"""`hypafilter bench optimize`: the same frames through a policy and through its `hypafilter optimize` rewrite, each
loaded alone in the kernel (the packet-rate bench's bridged namespaces).

Measured: frames/s of each (median of repeats), per-frame verdicts of each on probe frames (trace headers, rule
corners, and adversarial variants: truncated transport headers, first and later fragments, IP options, trailing
bytes, TCP and ICMP frames) — every frame that one delivers and the other does not is a mismatch — and every
original rule's packet counter against the sum of its copies' (the observing rules see the same packets). The
path lengths (rules evaluated per packet) come from a walk of the trees over the trace, for policies whose rules
are all header checks (ClassBench imports)."""

from __future__ import annotations

import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.ir import PROTO_ICMP, PROTO_TCP, PROTO_UDP
from hypafilter.optimize.emit import Result
from hypafilter.optimize.tree import path
from hypafilter.paths import BUILD_ROOT
from hypafilter.tools.bench import pktrate

ADVERSARIAL = ("truncated_l4", "fragment_first", "fragment_later", "ip_options", "trailing_bytes")
_LABEL = re.compile(r'--comment "?(\S+) rule (\d+)\b')


def trace_rows(trace: np.ndarray) -> list[tuple[int, int, int, int]]:
    return [(int(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in trace]


def probe_frames(rows, n: int, seed: int) -> list[tuple[int, bytes]]:
    """(uid, frame) probes: n trace headers as UDP, then TCP and ICMP twins of some, then adversarial variants."""
    from hypafilter.ops.verify import build_frame, malform

    rng = random.Random(seed)
    pick = [rows[rng.randrange(len(rows))] for _ in range(n)] if rows else []
    out: list[tuple[int, bytes]] = []
    uid = 1
    for src, dst, sport, dport in pick:
        h = {"src": src, "dst": dst, "proto": PROTO_UDP, "sport": sport, "dport": dport}
        f = build_frame(uid, h, b"hf-xy", pktrate.DST_MAC)
        out.append((uid, f))
        uid += 1
        r = rng.random()
        if r < 0.1:
            out.append((uid, build_frame(uid, {**h, "proto": PROTO_TCP, "flags": 0x10}, b"", pktrate.DST_MAC)))
            uid += 1
        elif r < 0.15:
            out.append((uid, build_frame(uid, {**h, "proto": PROTO_ICMP}, b"", pktrate.DST_MAC)))
            uid += 1
        elif r < 0.35:
            kind = ADVERSARIAL[rng.randrange(len(ADVERSARIAL))]
            base = f if rng.random() < 0.7 else build_frame(uid, {**h, "proto": PROTO_TCP}, b"", pktrate.DST_MAC)
            out.append((uid, malform(kind, _with_uid(base, uid), rng)))
            uid += 1
    return out


ADVERSARIAL6 = ("hbh", "dstopt", "rt0", "chain", "ah", "frag_first", "frag_later", "trunc_ext", "trunc_l4", "trunc_len")
_V6_ADDR = re.compile(r"\s-([sd]) ([0-9a-fA-F:.]+)(?:/(\d+))?(?=\s)")


def trace_rows6(text6: str, trace: np.ndarray, seed: int = 6) -> list[tuple[int, int, int, int]]:
    """IPv6 headers for a ClassBench trace of a set mapped into IPv6 (tools.classbench6, `text6` its ip6tables-save
    text, one rule per filter in order): each header's source and destination are drawn inside the mapped prefixes
    of the filter it was made for (the trace's FILTER_NUMBER), random below them; its ports are the trace's. A
    trace row for a filter the text does not have keeps the mapping of its IPv4 addresses (2001:db8:<a>::)."""
    import ipaddress

    from hypafilter.tools.classbench6 import BASE

    nets: list[dict[str, tuple[int, int]]] = []
    for ln in text6.splitlines():
        if not ln.startswith("-A "):
            continue
        got = {}
        for m in _V6_ADDR.finditer(ln + " "):
            got[m.group(1)] = (int(ipaddress.IPv6Address(m.group(2))), int(m.group(3) or 128))
        nets.append(got)
    rng = random.Random(seed)
    out = []
    for r in trace:
        src, dst, sport, dport, f = int(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[6])
        where = nets[f] if 0 <= f < len(nets) else {}
        addr = []
        for k, v4 in (("s", src), ("d", dst)):
            net, plen = where.get(k, (BASE | (v4 << 64), 96))
            low = 128 - plen
            addr.append(net | (rng.getrandbits(low) if low else 0))
        out.append((addr[0], addr[1], sport, dport))
    return out


def probe_frames6(rows, n: int, seed: int) -> list[tuple[int, bytes]]:
    """IPv6 (uid, frame) probes: n trace headers as UDP, then TCP and ICMPv6 twins of some, then adversarial IPv6
    variants of ops.verify6 (extension headers, AH, first and later fragments, truncated headers)."""
    from hypafilter.iptables.canonical import ip6_str
    from hypafilter.ops.verify import ID_MAC_PREFIX
    from hypafilter.ops.verify6 import build6

    rng = random.Random(seed)
    pick = [rows[rng.randrange(len(rows))] for _ in range(n)] if rows else []
    out: list[tuple[int, bytes]] = []
    uid = 1
    sent: list[dict] = []
    for src, dst, sport, dport in pick:
        out.append((uid, pktrate.udp6_frame(src, dst, sport, dport, ID_MAC_PREFIX + uid.to_bytes(4, "big"))))
        uid += 1
        h = {"src": ip6_str(src), "dst": ip6_str(dst), "proto": PROTO_UDP, "sport": sport, "dport": dport,
             "flags": "A", "type": 128, "code": 0}  # fmt: skip
        sent.append(h)
        r = rng.random()
        if r < 0.1:
            f = build6(uid, "normal", {**h, "proto": PROTO_TCP}, rng, sent, pktrate.DST_MAC, ID_MAC_PREFIX)
        elif r < 0.15:
            f = build6(uid, "normal", {**h, "proto": 58}, rng, sent, pktrate.DST_MAC, ID_MAC_PREFIX)
        elif r < 0.35:
            kind = ADVERSARIAL6[rng.randrange(len(ADVERSARIAL6))]
            p = PROTO_UDP if rng.random() < 0.7 else PROTO_TCP
            f = build6(uid, kind, {**h, "proto": p}, rng, sent, pktrate.DST_MAC, ID_MAC_PREFIX)
        else:
            continue
        out.append((uid, f))
        uid += 1
    return out


def _with_uid(frame: bytes, uid: int) -> bytes:
    return frame[:8] + uid.to_bytes(4, "big") + frame[12:]


def forget_state(rb: pktrate.RateBench) -> None:
    """Conntrack entries and `-m recent` lists outlive a reload of the rules: clear them, so that each policy sees
    the probes from the same empty state."""
    netns.run(["conntrack", "-F"], rb.ns_f, check=False)
    if getattr(rb, "family", 4) == 6:
        netns.run(["conntrack", "-F", "-f", "ipv6"], rb.ns_f, check=False)
    netns.run(["sh", "-c", 'for f in /proc/net/xt_recent/*; do [ -e "$f" ] && echo / > "$f"; done; true'], rb.ns_f)


def delivered(rb: pktrate.RateBench, probes: list[tuple[int, bytes]]) -> set[int]:
    from hypafilter.ops.verify import drain, frame_id, raw_socket, receive, send

    tx, rx = raw_socket(rb.ns_s, "s0"), raw_socket(rb.ns_r, "r0")
    try:
        drain(rx)
        got: set[int] = set()
        for i in range(0, len(probes), 2000):
            send(tx, [f for _, f in probes[i : i + 2000]])
            got |= {frame_id(f) for f in receive(rx, quiet=0.3)}
        return got - {None}
    finally:
        tx.close()
        rx.close()


def counters(rb: pktrate.RateBench) -> dict[tuple[str, int], int]:
    """(chain, 1-based position) -> packets, for every rule of the filter table (iptables-save -c)."""
    out: dict[tuple[str, int], int] = {}
    pos: dict[str, int] = {}
    for ln in netns.run([f"{rb.iptables}-save", "-c", "-t", "filter"], rb.ns_f).splitlines():
        m = re.match(r"^\[(\d+):\d+\] -A (\S+)", ln)
        if not m:
            continue
        chain = m.group(2)
        pos[chain] = pos.get(chain, 0) + 1
        out[(chain, pos[chain])] = int(m.group(1))
        lab = _LABEL.search(ln)
        if lab:  # a copy the optimiser labelled: counts for the original rule it names
            key = ("=" + lab.group(1), int(lab.group(2)))
            out[key] = out.get(key, 0) + int(m.group(1))
    return out


def counter_mismatches(orig: dict, opt: dict, res: Result) -> list[str]:
    """Original rules whose packet count differs from the sum of their copies' (rules moved into trees) or from
    the rule kept in place."""
    moved = {(s.chain, s.start + j + 1) for s in res.segments for j in range(len(s.rules))}
    bad = []
    for (chain, idx), n in orig.items():
        if chain.startswith("="):
            continue
        if (chain, idx) in moved:
            got = opt.get(("=" + chain, idx), 0)
        else:
            got = None  # kept in place: compared by the verdicts; positions shift around the tree jumps
        if got is not None and got != n:
            bad.append(f"{chain} rule {idx}: {n} packets in the original, {got} in its copies")
    return bad


def path_stats(res: Result, lo: np.ndarray, hi: np.ndarray, rows) -> dict:
    """Mean rules evaluated per packet of the trace in the original list and in the tree (one segment holding the
    whole chain, rules that are header checks alone: lo/hi [N, 4] = src, dst, sport, dport intervals, UDP)."""
    if len(res.segments) != 1 or res.segments[0].tree is None or not rows:
        return {}
    tree = res.segments[0].tree
    n_rules = len(lo)
    pin, pout, pmax = [], [], 0
    for src, dst, sport, dport in rows:
        hit = (lo[:, 0] <= src) & (src <= hi[:, 0]) & (lo[:, 1] <= dst) & (dst <= hi[:, 1])
        hit &= (lo[:, 2] <= sport) & (sport <= hi[:, 2]) & (lo[:, 3] <= dport) & (dport <= hi[:, 3])
        first = np.flatnonzero(hit)
        pin.append(int(first[0]) + 1 if len(first) else n_rules)

        def fm(rules, hit=hit):
            return next((k for k, i in enumerate(rules) if hit[i]), None)

        n, _ = path(tree, (src, dst, PROTO_UDP, sport, dport), fm)
        pout.append(n)
        pmax = max(pmax, n)
    return {
        "path_mean_in": round(statistics.fmean(pin), 2),
        "path_mean_out": round(statistics.fmean(pout), 2),
        "path_max_out": pmax,
    }


def path_stats6(res: Result, rows) -> dict:
    """path_stats of an IPv6 rewrite (one tree over the whole chain): the trace's headers ranked in the tree's
    RankSpace, the first rule from the rules' whole-packet boxes on the same ranks (exact: ClassBench rules are
    header checks alone)."""
    import bisect

    if len(res.segments) != 1 or res.segments[0].tree is None or not rows:
        return {}
    seg = res.segments[0]
    tree, sp = seg.tree, seg.space
    lo, hi, own = tree.whole.lo, tree.whole.hi, tree.whole.owner
    n_rules = len(seg.rules)
    pin, pout, pmax = [], [], 0
    for src, dst, sport, dport in rows:
        pt = np.array(
            [bisect.bisect_right(sp.starts[0], src) - 1, bisect.bisect_right(sp.starts[1], dst) - 1, PROTO_UDP,
             sport, dport], dtype=np.int64)  # fmt: skip
        boxes = np.all((lo <= pt) & (pt <= hi), axis=1)
        hit = np.zeros(n_rules, dtype=bool)
        hit[own[boxes]] = True
        first = np.flatnonzero(hit)
        pin.append(int(first[0]) + 1 if len(first) else n_rules)

        def fm(rules, hit=hit):
            return next((k for k, i in enumerate(rules) if hit[i]), None)

        n, _ = path(tree, tuple(int(x) for x in pt), fm)
        pout.append(n)
        pmax = max(pmax, n)
    return {
        "path_mean_in": round(statistics.fmean(pin), 2),
        "path_mean_out": round(statistics.fmean(pout), 2),
        "path_max_out": pmax,
    }


def _nft_load(rb: pktrate.RateBench, text: str) -> str:
    netns.run(["nft", "flush", "ruleset"], rb.ns_f)
    return netns.run(["nft", "-f", "-"], rb.ns_f, input=text)


def nft_peers(rb: pktrate.RateBench, text: str, tmp: Path) -> dict:
    """The policy in nft's own terms (iptables-restore-translate, counters left out as `nft -o` needs) and as
    `nft -o` rewrites it (adjacent rules merged into set and verdict-map lookups): {"nft": text, "nft_o": text or
    None, "nft_o_merges": n, "nft_o_error": words}."""
    src = tmp / "policy.rules"
    src.write_text(text)
    netns.run(["nft", "flush", "ruleset"], rb.ns_f)
    _nft_load(rb, netns.run(["iptables-restore-translate", "-f", str(src)], rb.ns_f))
    decl = re.sub(r" counter packets \d+ bytes \d+", "", netns.run(["nft", "list", "ruleset"], rb.ns_f))
    out = {"nft": decl, "nft_o": None, "nft_o_merges": 0, "nft_o_error": None}
    netns.run(["nft", "flush", "ruleset"], rb.ns_f)
    try:
        said = netns.run(["nft", "-o", "-f", "-"], rb.ns_f, input=decl)
    except netns.CommandError as e:
        said = [ln.strip() for ln in str(e).splitlines() if "Error:" in ln]
        out["nft_o_error"] = f"{said[0]} ({len(said)} such)" if said else str(e)[-300:]
        return out
    out["nft_o_merges"] = said.count("Merging:")
    out["nft_o"] = netns.run(["nft", "list", "ruleset"], rb.ns_f)
    return out


def sets_peer(rb: pktrate.RateBench, text: str) -> dict:
    """The policy as nft verdict maps (tools.bench.nftsets), loaded once to see that the kernel takes it:
    {"text": nft text or None, "summary": its figures, "error": why there is none}."""
    from hypafilter.tools.bench.nftsets import nft_sets

    try:
        peer = nft_sets(text)
    except HypafilterError as e:
        return {"text": None, "summary": {}, "error": str(e)}
    try:
        _nft_load(rb, peer.text)
    except netns.CommandError as e:
        said = [ln.strip() for ln in str(e).splitlines() if "Error:" in ln]
        return {
            "text": None,
            "summary": peer.summary(),
            "error": f"{said[0]} ({len(said)} such)" if said else str(e)[-300:],
        }
    finally:
        netns.run(["nft", "flush", "ruleset"], rb.ns_f)
    return {"text": peer.text, "summary": peer.summary(), "error": None}


def k0_program(text: str, name: str, strategy: str, min_segment: int = 16) -> tuple[Result, dict]:
    """The hybrid's k = 0 path of `strategy` as the rewrite to compare: the program compile writes for the policy
    (not live: K0 walks FULL, or strategy tree's trees, then the chain policy), with `-A FORWARD -j <prefix>MAIN`.
    A frame the bench sends carries no mark, so MAIN sends it to K0: the path every untagged, unparsed or stale
    frame takes, and every frame while an update shunts everything."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.analysis.program import build_program
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.netfilter.restore import render_iptables

    t0 = time.monotonic()
    config = Config(strategy=strategy, tree_min_segment=min_segment)
    policy = parse_policy(text, filename=name, base_chain="FORWARD", config=config)
    prog = build_program(build_plan(policy, config), strategy)
    body = render_iptables(prog).rstrip("\n")
    if not body.endswith("COMMIT"):
        raise HypafilterError("the rendered program does not end in COMMIT")
    out = body[: -len("COMMIT")] + f"-A FORWARD -j {prog.main}\nCOMMIT\n"
    rules_out = sum(1 for ln in out.splitlines() if ln.startswith("-A "))
    res = Result(out, len(policy.original_rules), rules_out, build_s=time.monotonic() - t0)
    summary = {
        "k0_strategy": strategy,
        "rules_in": res.rules_in,
        "rules_out": rules_out,
        "expansion": round(res.expansion, 3),
        **prog.tree_stats,
        "build_s": round(res.build_s, 3),
    }
    return res, summary


def k0_live_program(text: str, name: str, base_text: str | None = None, min_segment: int = 16) -> tuple[Result, dict]:
    """Strategy tree's live K0 tree (docs/optimize.md, "The live K0 tree") as a deployment on xdp loads it, to compare
    with the policy alone: the policy's own rules with `-A FORWARD -j <prefix>K0T` ahead of them (the path of every
    frame the fast path marks HF_MARK_K0_TREE; a frame K0T returns meets the policy's rules, as in a live deployment)
    and the tool's chains. `base_text`: the policy the tree was last built from (a follow since: its changes are
    diverted ahead of the tree); None builds the tree of `text` (a rebuild). `build_s`: the program's build."""
    from hypafilter.analysis.plan import build_plan
    from hypafilter.analysis.program import build_program
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.netfilter.restore import render_iptables

    config = Config(strategy="tree", tree_min_segment=min_segment)

    def program(t: str, fresh: bool):
        policy = parse_policy(t, filename=name, base_chain="FORWARD", config=config)
        plan = build_plan(policy, config, live=True)
        plan.k0_tree, plan.trees_fresh = True, fresh
        t0 = time.monotonic()
        return policy, build_program(plan, "tree"), time.monotonic() - t0

    if base_text is not None:
        program(base_text, True)  # the tree of the last rebuild, kept by this process
    policy, prog, build_s = program(text, base_text is None)
    k0t = prog.name("K0T")
    if k0t not in prog.chains:
        raise HypafilterError(f"no live K0 tree: {prog.tree_stats.get('k0_tree')}")
    body = [ln for ln in render_iptables(prog).splitlines() if ln.startswith((":", "-A "))]
    lines = text.splitlines()
    end = max(i for i, ln in enumerate(lines) if ln.strip() == "COMMIT")
    first = next(i for i, ln in enumerate(lines) if ln.startswith("-A FORWARD"))
    out = lines[:first] + [ln for ln in body if ln.startswith(":")] + [f"-A FORWARD -j {k0t}"]
    out += lines[first:end] + [ln for ln in body if ln.startswith("-A ")] + lines[end:]
    out_text = "\n".join(out) + "\n"
    rules_out = sum(1 for ln in out if ln.startswith("-A "))
    res = Result(out_text, len(policy.original_rules), rules_out, build_s=build_s)
    return res, {"k0_strategy": "tree-live", "rules_in": res.rules_in, "rules_out": rules_out, **prog.tree_stats,
                 "build_s": round(build_s, 3)}  # fmt: skip


def run(text: str, res: Result, rows, seconds: float = 2.0, repeats: int = 3, probes: int = 5000,
        seed: int = 1, backend: str = "nft", peers: bool = False, log=print, family: int = 4,
        tag: str | None = None) -> dict:  # fmt: skip
    """The measurement; `rows` are (src, dst, sport, dport) headers (UDP) for the rate frames and the probes.
    `peers` (nft back end only): the same through the policy in nft, as `nft -o` rewrites it and as nft verdict maps
    (`sets_peer`: pps_nft_sets, nft_sets_mismatches, or nft_sets_error). `family` 6: an
    ip6tables policy and its rewrite, IPv6 frames (rows with 128-bit addresses; probe_frames6). `tag`: the
    namespaces' prefix (default a random `hto<n>`)."""
    if not rows:
        raise HypafilterError("bench optimize needs headers to send: give --trace")
    if peers and backend != "nft":
        raise HypafilterError("the nft peers are measured with the nft back end")
    if family == 6 and (peers or backend != "nft"):
        raise HypafilterError(
            "bench optimize -6 runs with ip6tables-nft only (no --peers, no --backend legacy: docs/optimize.md)"
        )
    build = BUILD_ROOT / "bench"
    blaster = pktrate.build_blaster(build)
    out: dict = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        pktrate.RateBench(blaster, tag or f"hto{random.randrange(10**4)}", backend, family) as rb,
    ):
        frames = Path(tmp) / "frames.bin"
        pktrate.write_frames(frames, ((s, d, sp, dp, 0) for s, d, sp, dp in rows), family)
        pr = probe_frames6(rows, probes, seed) if family == 6 else probe_frames(rows, probes, seed)

        def ipt(body):
            def load():
                if peers:  # an nft peer's tables out of the way
                    netns.run(["nft", "flush", "ruleset"], rb.ns_f)
                rb.load_restore(body)

            return load

        loads = {"in": ipt(text), "out": ipt(res.text)}
        if peers:
            nft = nft_peers(rb, text, Path(tmp))
            out["nft_o_merges"], out["nft_o_error"] = nft["nft_o_merges"], nft["nft_o_error"]
            loads["nft"] = lambda: _nft_load(rb, nft["nft"])
            if nft["nft_o"] is not None:
                loads["nft_o"] = lambda: _nft_load(rb, nft["nft_o"])
            sets = sets_peer(rb, text)
            out.update(sets["summary"])
            out["nft_sets_error"] = sets["error"]
            if sets["text"] is not None:
                loads["nft_sets"] = lambda: _nft_load(rb, sets["text"])
        got, cnt = {}, {}
        for which, load in loads.items():
            load()
            forget_state(rb)
            got[which] = delivered(rb, pr)
            if which in ("in", "out"):
                cnt[which] = counters(rb)
        bad = sorted(got["in"] ^ got["out"])
        out["mismatches"] = len(bad)
        out["mismatch_uids"] = bad[:20]
        out["counter_mismatches"] = counter_mismatches(cnt["in"], cnt["out"], res)
        for which in set(loads) - {"in", "out"}:
            out[f"{which}_mismatches"] = len(got["in"] ^ got[which])
        out["probes"] = len(pr)
        out["backend"] = backend
        out["delivered"] = len(got["in"])
        if repeats <= 0:
            return out
        loads["empty"] = rb.reset_firewall  # no rules at all: the cost of the path without a firewall
        pps: dict[str, list[float]] = {k: [] for k in loads}
        for _ in range(repeats):
            for which, load in loads.items():
                load()
                m = rb.measure(frames, seconds)
                pps[which].append(m["sent"] / m["seconds"] if m["seconds"] else 0.0)
            log("  pps " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in pps.items()))
        for which, v in pps.items():
            out[f"pps_{which}"] = round(statistics.median(v))
        out["speedup"] = round(out["pps_out"] / out["pps_in"], 2) if out["pps_in"] else None
        for which in set(loads) - {"in", "out", "empty"}:
            out[f"speedup_{which}"] = round(out[f"pps_{which}"] / out["pps_in"], 2) if out["pps_in"] else None
        # HiTables' second figure: the speedup of the filtering alone, the empty path's time per frame taken off
        t_io, t_in, t_out = (1 / out[f"pps_{k}"] if out[f"pps_{k}"] else 0.0 for k in ("empty", "in", "out"))
        out["speedup_without_io"] = round((t_in - t_io) / (t_out - t_io), 2) if t_out > t_io else None
    return out


def compare(rb: pktrate.RateBench, text: str, res: Result, probes: list[tuple[int, bytes]]) -> dict:
    """The probes through the policy and through its rewrite, each loaded alone in `rb` (its family's tables),
    conntrack and `-m recent` cleared before each: frames one delivers and the other does not, and moved rules whose
    packet count differs from the sum of their copies'."""
    got, cnt = {}, {}
    for which, body in (("in", text), ("out", res.text)):
        rb.load_restore(body)
        forget_state(rb)
        got[which] = delivered(rb, probes)
        cnt[which] = counters(rb)
    return {
        "probes": len(probes),
        "delivered": len(got["in"]),
        "mismatches": len(got["in"] ^ got["out"]),
        "mismatch_uids": sorted(got["in"] ^ got["out"])[:10],
        "counter_mismatches": counter_mismatches(cnt["in"], cnt["out"], res),
    }


def fuzz(seeds, packets: int = 3000, params=None, min_segment: int = 4, log=print, k0: str | None = None) -> list[dict]:
    """`optimize` against the kernel on the fuzzer's random policies (tools.fuzz.random_policy: user chains with
    RETURN and goto, MARK read back, conntrack states, strings, observing rules, per-rule state), trees forced small
    (`params`, default binth 2): each policy and its rewrite alone in the kernel, the same probes (rule corners,
    drawn headers, malformed frames, attack shapes) through both. One report per seed. `k0`: a strategy whose k = 0
    path (`k0_program`, runs of `min_segment`) is the rewrite instead (strategy tree: the K0 tree)."""
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops.verify import ATTACK_SHAPES, ProbeSpec
    from hypafilter.optimize.emit import optimize
    from hypafilter.optimize.tree import Params
    from hypafilter.tools.fuzz import random_policy

    params = params or Params(binth=2)
    blaster = pktrate.build_blaster(BUILD_ROOT / "bench")
    out = []
    with pktrate.RateBench(blaster, f"htz{random.randrange(10**4)}") as rb:
        for seed in seeds:
            text = random_policy(seed, rules=random.Random(seed).randint(20, 40))
            if k0:
                res, summary = k0_program(text, f"fuzz-{seed}.rules", k0, min_segment)
            else:
                res = optimize(text, f"fuzz-{seed}.rules", params, min_segment=min_segment)
            policy = parse_policy(text, f"fuzz-{seed}.rules")
            spec = ProbeSpec(packets, seed=seed, cover=True, attack=ATTACK_SHAPES, attack_share=0.1)
            pr = [(p.uid, p.frame) for p in spec.probes(policy, dst_mac=pktrate.DST_MAC)]
            got, cnt = {}, {}
            for which, body in (("in", text), ("out", res.text)):
                rb.load_restore(body)
                forget_state(rb)
                got[which] = delivered(rb, pr)
                cnt[which] = counters(rb)
            rep = {
                "seed": seed,
                "rules_in": res.rules_in,
                "rules_out": res.rules_out,
                "trees": summary["trees"] if k0 else len(res.segments),
                "rules_in_trees": summary["rules_in_trees"] if k0 else sum(len(s.rules) for s in res.segments),
                "probes": len(pr),
                "delivered": len(got["in"]),
                "mismatches": len(got["in"] ^ got["out"]),
                "mismatch_uids": sorted(got["in"] ^ got["out"])[:10],
                "counter_mismatches": counter_mismatches(cnt["in"], cnt["out"], res),
            }
            log(f"seed {seed}: {rep['rules_in']} rules, {rep['trees']} trees over {rep['rules_in_trees']}, "
                f"{rep['mismatches']} mismatches, {len(rep['counter_mismatches'])} counter mismatches")  # fmt: skip
            out.append(rep)
    return out

"""The policy sync service's IPv6 side (docs/ipv6.md "Following ip6tables"): ip6tables is the IPv6 policy as
iptables is the IPv4 one, and fail2ban, ufw and Docker edit both. A committed nf_tables transaction of family ip6
that another process made is followed as the worker follows family ip, but for IPv6 alone:

1. **fail safe for IPv6**, at once, before anything is read: the xdp program's IPv6 path stops deciding (its
   `hfx6_hold` word, one bpf() write: every IPv6 frame unparsed, value 0, so k = 0 and ip6tables, which already
   holds the change, decides it whole). IPv4 frames are decided on as before: their tables, CONTROL and the shim's
   generation are not touched. The emulated NIC's dual-stack core (docs/ipv6.md "## emu") has no IPv6 hold of its
   own: there the hold is the IPv4 fail safe (everything shunted, every tag stale), and the apply is an update of
   the deployment with the new IPv6 side (`deploy.follow`: register writes, or a new core). (On xdp without
   `xdp_ipv6`, and on the emulated NIC without `emu_ipv6`, no fast path decides IPv6 frames: nothing to hold.)
2. **read**: `ip6tables-save` of every table between two reads of the same nf_tables generation; a listing whose
   digest or fingerprint is the deployed IPv6 side's is unchanged, any other is the new IPv6 policy.
3. **apply**: `deploy.follow6` — the state's IPv6 side becomes the live one, and the IPv6 table set is built from
   it again and written into the running program (a rebuild of the IPv6 tables: the update buffer holds IPv4
   entries only, there is no overlay for a ranked IPv6 plan yet); then the hold is lifted, unless a newer ip6 change
   came meanwhile. Tables that no longer fit the running program start a new one (`deploy.follow(rebuild=True)`
   with the new IPv6 side: the IPv4 side is shunted for that update, as any new program's). A policy that cannot
   go into the program (tables besides filter, set matches) keeps the hold: every IPv6 frame to ip6tables.

A listing that cannot be read or parsed, an apply that fails, or a base chain of an ip6 nftables table that is not
ip6tables' at a hook a NIC frame meets leaves the hold in force (fail closed for IPv6) and the error in the status
file's `ipv6` part. In mode kernel (no IPv6 side deployed: ip6tables as the operator has it) nothing decides IPv6
frames but ip6tables, so there is nothing to follow.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque

from hypafilter.errors import HypafilterError
from hypafilter.netfilter import ip6
from hypafilter.ops import deploy
from hypafilter.ops.policysync import live
from hypafilter.ops.policysync.nftevents import NfTables

IP6TABLES_TABLES = set(ip6.BUILTIN)  # the ip6 nftables tables ip6tables-nft makes; any other is foreign to it
IP6T_SO_GET_INFO = 64  # IP6T_BASE_CTL (include/uapi/linux/netfilter_ipv6/ip6_tables.h), at SOL_IPV6
# the IPv6 update buffer in use and no ip6tables change for this long: its lazy rebuild (as the IPv4 buffer's
# REBUILD_IDLE_S; HF_REBUILD6_IDLE_S in the service's environment: the tests' shorter wait)
REBUILD6_IDLE_S = float(os.environ.get("HF_REBUILD6_IDLE_S", "60"))
LEGACY_POLL_S = 0.05  # the legacy ip6tables tables are read this often (xtables sends no event)


# the operator's part of a listing and its digest (netfilter.ip6: drift reads them too, without this module)
tool_prefix = ip6.tool_prefix
strip6 = ip6.strip6


def normal_text(text: str) -> str:
    """An ip6tables-save listing as a policy file: comment lines out, every chain's counters [0:0]."""
    out = []
    for ln in text.splitlines():
        if not ln.strip() or ln.startswith("#"):
            continue
        if ln.startswith(":"):
            ln = ln.rsplit(" [", 1)[0] + " [0:0]"
        out.append(ln)
    return "\n".join(out) + "\n" if out else ""


def chunks(text: str) -> dict[str, str]:
    """Each table's part of a listing (from its *table line to its COMMIT)."""
    out: dict[str, list[str]] = {}
    table = None
    for ln in text.splitlines():
        if ln.startswith("*"):
            table = ln[1:].strip()
            out[table] = []
        if table is not None:
            out[table].append(ln)
        if ln == "COMMIT":
            table = None
    return {t: "\n".join(lines) + "\n" for t, lines in out.items()}


digest6 = ip6.digest6


def fingerprint_of(text: str, tables) -> str:
    """ip6.fingerprint of `tables`, from a listing of every table (the same lines in the same order)."""
    parts = chunks(text)
    lines: list[str] = []
    for t in tables:
        if t in parts:
            lines += ip6._normal(parts[t])
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def unchanged(text: str, six: dict) -> bool:
    """Whether listing `text` is the IPv6 side the deployment has: the operator's part of it (the tool's chains and
    jump stripped) the one a follow recorded (`live_digest`), or the tables a deploy or follow loaded as they are (their
    fingerprint, the tool's chains included) and no other ip6tables table. The tool's own chains, which a follow
    rewrites, are never an operator's change."""
    if six.get("live_digest") and digest6(strip6(text, tool_prefix(six))) == six["live_digest"]:
        return True
    tables = list(six.get("tables") or ())
    return (
        bool(six.get("fingerprint"))
        and set(chunks(text)) == set(tables)
        and fingerprint_of(text, tables) == six["fingerprint"]
    )


def listing6(ns: str | None, generation) -> tuple[str, int]:
    """(ip6tables-save of every table, the generation it shows), read between two reads of the same generation."""
    from hypafilter import netns

    for _ in range(live.SNAPSHOT_TRIES):
        g0 = generation()
        text = netns.run(["ip6tables-save"], ns)
        if generation() == g0:
            return text, g0
    raise HypafilterError(f"ip6tables kept changing while it was read ({live.SNAPSHOT_TRIES} tries)")


def live_v6(text: str, st: dict) -> ip6.V6Policy:
    """The live IPv6 policy of listing `text` (what ip6tables holds; the kernel took it, so no kernel check)."""
    six = st.get("ipv6") or {}
    where = st["site"].get("netns") or "this namespace"
    body = normal_text(strip6(text, tool_prefix(six)))
    if not body:
        raise HypafilterError(f"ip6tables of {where} holds no table: the IPv6 side has no filter table any more")
    return ip6.parse(body, f"live ip6tables ({where})", six.get("base_chain") or st["base_chain"], validate=False)


def foreign6(ns: str | None, nic_mode: str) -> list[str]:
    """Base chains of ip6 nftables tables that are not ip6tables' (an operator's `nft` table) at the hooks a NIC
    frame meets: the IPv6 fast path would decide frames without them."""
    nft = NfTables(ns)
    try:
        chains = nft.base_chains()
    finally:
        nft.close()
    return [
        f"ip6 {c.table} {c.name} (hook {c.hook}, priority {c.prio})"
        for c in chains
        if c.family == "ip6" and c.table not in IP6TABLES_TABLES and c.hook in (*live.HOOKS[nic_mode], "ingress")
    ]


class Legacy6:
    """The legacy (xtables) ip6tables tables of the firewall namespace, watched without a process: ip6tables-legacy
    announces nothing, so a thread that lives in the namespace reads which tables exist
    (/proc/net/ip6_tables_names) and each one's entry count and size (IP6T_SO_GET_INFO: asked only of listed tables,
    which asking would otherwise create) every LEGACY_POLL_S, and wakes the worker (a pipe it selects on) when they
    change. A legacy table filters IPv6 frames beside ip6tables-nft's (both are netfilter hooks): the IPv6 side
    cannot decide frames without it, so one that holds a rule or a policy other than ACCEPT keeps the IPv6 hold
    (`rules`)."""

    def __init__(self, ns: str | None):
        import os
        import threading

        self.ns = ns
        self.seen: tuple | None = None
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        self.stop = threading.Event()
        self.ready = threading.Event()  # the first read done (what `rules` needs at the service's start)
        self.thread = threading.Thread(target=self.run, name="legacy6", daemon=True)
        self.thread.start()

    def fileno(self) -> int:
        return self.rfd

    def read(self, sock) -> tuple | None:
        """((table, entries, size), ...) of the legacy ip6tables tables (None: none exists)."""
        import ctypes
        import socket

        from hypafilter.ops.policysync.newflows import IPT_GETINFO, _libc

        try:
            with open("/proc/thread-self/net/ip6_tables_names", "rb") as f:
                names = f.read().split()
        except OSError:
            return None  # no ip6_tables in this namespace's kernel: no legacy table
        out = []
        for name in sorted(names):
            buf = ctypes.create_string_buffer(IPT_GETINFO.pack(name, 0, *(0,) * 10, 0, 0), IPT_GETINFO.size)
            size = ctypes.c_uint32(IPT_GETINFO.size)
            rc = _libc.getsockopt(sock.fileno(), socket.IPPROTO_IPV6, IP6T_SO_GET_INFO, buf, ctypes.byref(size))
            out.append((name.decode(), *(IPT_GETINFO.unpack(buf.raw)[-2:] if rc == 0 else (-1, ctypes.get_errno()))))
        return tuple(out) or None

    def run(self) -> None:
        import os
        import socket

        from hypafilter import netns

        with netns.inside(self.ns):  # this thread stays in the firewall namespace
            sock = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_RAW)
            try:
                self.seen = self.read(sock)
                self.ready.set()
                while not self.stop.wait(LEGACY_POLL_S):
                    now = self.read(sock)
                    if now != self.seen:
                        self.seen = now
                        os.write(self.wfd, b"x")
            finally:
                sock.close()

    def drain(self) -> None:
        import os

        try:
            while os.read(self.rfd, 64):
                pass
        except BlockingIOError:
            pass

    def rules(self) -> list[str]:
        """The legacy tables that filter (a rule, or a built-in chain's policy other than ACCEPT), as
        ip6tables-legacy-save lists them: read only while one exists."""
        from hypafilter import netns

        if not self.ready.wait(2.0):
            raise HypafilterError("the legacy ip6tables tables were not read yet")
        if not self.seen:
            return []
        bad = []
        for t, text in chunks(netns.run(["ip6tables-legacy-save"], self.ns)).items():
            lines = text.splitlines()
            if any(ln.startswith("-A ") for ln in lines) or any(
                ln.startswith(":") and ln.split()[1] not in ("ACCEPT", "-") for ln in lines
            ):
                bad.append(t)
        return bad

    def close(self) -> None:
        import os

        self.stop.set()
        self.thread.join(timeout=2)
        os.close(self.rfd)
        os.close(self.wfd)


class Follower6:
    """ip6tables followed for the deployment the IPv4 follower `f` (ops.policysync.worker.Follower) keeps in step:
    its state, target, nf_tables sockets and log are shared; its fail safe and apply are IPv6's alone."""

    def __init__(self, f):
        self.f = f
        self.dirty = False  # a message of the transaction being read touched an ip6 table
        self.pending = False  # an ip6 change of another process not applied yet
        self.pending_since: float | None = None
        self.lost = False  # events were lost: read ip6tables again
        self.safe = False  # the IPv6 hold in force
        self.error = ""
        self.generation = 0
        self.last_try = 0.0
        self.last_how = ""
        self.starting_nic: dict | None = None  # a new program of a running follow, not in the state yet
        self.emu_took = False  # the emulated NIC's IPv6 hold: the IPv4 follower's fail safe, taken by this side
        self.legacy: Legacy6 | None = None  # the legacy ip6tables tables' watch, set by the worker's `serve`
        self.counts = {"changes": 0, "applied": 0, "unchanged": 0, "failed": 0, "new_programs": 0, "held": 0}
        self.counts["rebuilds"] = 0  # the IPv6 update buffer's idle rebuilds (xdp)
        self.last_apply_t = time.monotonic()  # the last change applied (what the idle rebuild waits after)
        self.lag_safe: deque[float] = deque(maxlen=2000)  # ms: events read -> the IPv6 path decides nothing
        self.lag_apply: deque[float] = deque(maxlen=2000)  # ms: events read -> it decides by the new policy

    def mode(self) -> str:
        return (self.f.state(fresh=False).get("ipv6") or {}).get("mode", "kernel")

    def _nics(self) -> list[dict]:
        st = self.f.state(fresh=False)
        nics = [st["nic"]]
        for extra in ((self.f.applying or {}).get("nic"), self.starting_nic):
            if extra and extra.get("pin") not in {n.get("pin") for n in nics}:
                nics.append(extra)
        return nics

    def emu_holds(self) -> bool:
        """Whether the deployment's IPv6 side is decided in the emulated NIC's dual-stack core (docs/ipv6.md "## emu"),
        which has no hold of its own: there the IPv6 hold is the IPv4 follower's fail safe (everything shunted, every
        tag stale: the live rules of both families decide), lifted only when neither family has a change pending."""
        st = self.f.state(fresh=False)
        return st.get("target", "emu") == "emu" and bool((st.get("tables") or {}).get("v6"))

    def _hold(self, nic: dict, on: bool) -> bool:
        self.f.state(fresh=False)  # (the target is known once a state was read)
        tgt = self.f._tgt
        if getattr(tgt, "name", "") == "emu":
            if on:
                if not self.emu_holds():
                    return False
                self.f.fail_safe()
                self.emu_took = True
            elif self.emu_took and not (self.f.pending or self.f.lost or self.f.in_follow):
                if self.f.safe:
                    self.f.release()
                self.emu_took = False
            return True
        return bool(tgt.hold_ipv6(nic, on)) if hasattr(tgt, "hold_ipv6") else False

    def fail_safe(self) -> bool:
        """The IPv6 path of every program that may decide (the deployed one, one a running follow made live or is
        starting) decides nothing from here. True when a program had an IPv6 path to hold."""
        if self.safe:
            return False
        held = False
        for i, nic in enumerate(self._nics()):
            try:
                held |= self._hold(nic, True)
            except HypafilterError:
                if i == 0:
                    raise  # a program being replaced may be gone: the deployed one must hold
        self.safe = True
        return held

    def starting(self, nic: dict) -> None:
        """A new program of a running follow, before it decides: held too while the hold is in force. Never raises
        into the update (its step would not roll back): a hold that could not be written is written again by the
        next sync's fail safe (`safe` cleared), which a pending change brings at once."""
        self.starting_nic = nic
        if self.safe and getattr(self.f._tgt, "name", "") != "emu":  # (emu: the update's watch.hold() keeps it held)
            try:
                self._hold(nic, True)
            except (HypafilterError, OSError) as e:
                self.safe = False
                self.f.log(f"IPv6 hold of the new program: {e}")

    def release(self) -> None:
        """The hold lifted: the program decides IPv6 frames by the deployment's IPv6 table set again, if the state
        has one (an IPv6 policy that cannot go into the program keeps the hold for good: `follow6`'s "held")."""
        st = self.f.state()
        emu = getattr(self.f._tgt, "name", "") == "emu"  # (its hold, the IPv4 fail safe, is lifted whatever the plan)
        self._hold(st["nic"], not emu and not (st.get("tables") or {}).get("v6"))
        self.safe = False

    def commit(self, t0: float) -> None:
        """A committed transaction of another process touched an ip6 table: pending, and the hold at once."""
        if not self.pending:
            self.pending, self.pending_since = True, t0
            self.counts["changes"] += 1
        if not self.safe and self.mode() != "kernel":
            try:
                if self.fail_safe():  # (nothing to hold where no fast path decides IPv6: no lag either)
                    self.lag_safe.append((time.monotonic() - t0) * 1000)
            except (HypafilterError, OSError) as e:
                self.error = f"IPv6 fail safe: {e}"

    def hold(self) -> bool:
        """Whether a newer ip6 change came while one was applied (the IPv4 follower reads the queued events)."""
        self.f.hold()
        return self.pending or self.lost

    def holds_all(self) -> bool:
        """Whether an ip6 change is pending that the whole fast path must stay held for (the emulated NIC, whose IPv6
        hold is the IPv4 fail safe): the IPv4 follower's `hold` then keeps an update from releasing it."""
        return (self.pending or self.lost) and self.emu_holds()

    def due(self) -> bool:
        retry = bool(self.error) and time.monotonic() - self.last_try >= 2.0
        return self.pending or self.lost or retry

    def sync(self, reason: str) -> None:
        """Read ip6tables and bring the IPv6 side into step with it."""
        t0 = self.pending_since
        self.last_try = time.monotonic()
        self.pending, self.pending_since, self.lost = False, None, False
        try:
            st = self.f.state()
            six = st.get("ipv6") or {"mode": "kernel"}
            if six.get("mode", "kernel") == "kernel":
                self.counts["unchanged"] += 1  # nothing of hypafilter's decides IPv6: ip6tables as it is
                if self.safe:
                    self.release()
                self.error = ""
                return
            others = foreign6(self.f.ns, st.get("nic_mode", "bridge"))
            if others:
                raise HypafilterError(
                    "ip6 nftables base chains besides ip6tables' filter the frames the fast path decides: "
                    + "; ".join(others)
                )
            legacy = self.legacy.rules() if self.legacy is not None else []
            if legacy:
                raise HypafilterError(
                    f"legacy ip6tables (xtables) tables hold rules ({', '.join(legacy)}): they filter IPv6 frames "
                    "beside ip6tables-nft's, and the fast path cannot follow them (ip6tables-legacy announces no "
                    "change); move their rules into ip6tables (nf_tables)"
                )
            text, self.generation = listing6(self.f.ns, self.f.nft.generation)
            # a follow that failed while it wrote the program's IPv6 maps left them unknown (deploy.follow6's
            # `writing`): held until the whole table set is written again, even for an unchanged ip6tables
            writing = bool(((st.get("tables") or {}).get("v6") or {}).get("writing"))
            if unchanged(text, six) and not writing:
                self.counts["unchanged"] += 1
                # at the start too: a worker that ended mid-apply may have left the program's hold in force
                if (self.safe or reason == "start") and not self.hold():
                    self.release()
            else:
                self.fail_safe()
                v6 = live_v6(text, st)
                live6 = digest6(strip6(text, tool_prefix(six)))
                r = deploy.follow6(v6, live6, self.f.log, abort=self.f.stopping, rebuild=writing)
                how = r["how"]
                if how == "new program":
                    self.f.log(f"IPv6 {reason}: {r['why']}: a new program")
                    self.new_program(v6)
                    self.counts["new_programs"] += 1
                elif how == "update":  # the emulated NIC: an update of the deployment with the new IPv6 side
                    self.new_program(v6, rebuild=False, live6=live6)
                self.f.state()
                self.last_how = how
                self.last_apply_t = time.monotonic()
                self.counts["applied"] += 1
                self.counts["held"] += how == "held"  # held for good: ip6tables decides every IPv6 frame
                if not self.hold():
                    self.release()  # (release keeps the hold of a policy that cannot go into the program)
                self.f.log(f"IPv6 {reason}: {how}{' (' + r['why'] + ')' if r['why'] else ''}")
            if t0 is not None:
                self.lag_apply.append((time.monotonic() - t0) * 1000)
            self.error = ""
        except (HypafilterError, OSError) as e:
            self.counts["failed"] += 1
            self.error = f"IPv6 {reason}: {e}"
            self.f.log(f"cannot follow ip6tables: {self.error}")
            try:
                self.fail_safe()
            except (HypafilterError, OSError):
                pass

    def maybe_rebuild(self) -> None:
        """The IPv6 update buffer's lazy rebuild when idle (xdp; docs/ipv6.md "The update buffer for IPv6"): a buffer
        in use (a slot, or a static entry masked off) and no ip6tables change for REBUILD6_IDLE_S: the whole IPv6
        table set of the deployment's IPv6 side rewritten into the running program under the hold (which empties
        the buffer), or a new program where it no longer fits. A buffer more than half full is rebuilt at once by
        the change that fills it (deploy.follow6)."""
        if self.pending or self.lost or self.safe or self.error:
            return
        if time.monotonic() - self.last_apply_t < REBUILD6_IDLE_S:
            return
        st = self.f.state(fresh=False)
        buf = ((st.get("tables") or {}).get("v6") or {}).get("buffer") or {}
        if st.get("target") != "xdp" or not (buf.get("used") or buf.get("invalid")):
            return
        six = st.get("ipv6") or {}
        self.last_apply_t = time.monotonic()
        try:
            v6 = ip6.V6Policy.from_state(six)
            self.fail_safe()
            r = deploy.follow6(v6, six.get("live_digest", ""), self.f.log, abort=self.f.stopping, rebuild=True)
            if r["how"] == "new program":
                self.new_program(v6)
                self.counts["new_programs"] += 1
            self.f.state()
            self.counts["rebuilds"] += 1
            self.f.log(f"IPv6 update buffer: lazy rebuild ({r['how']}) after {REBUILD6_IDLE_S:g} s idle")
        except (HypafilterError, OSError) as e:
            # The hold stays (the maps may be half written): `sync` tries again every 2 s (`due`) and releases
            # only once it has written the whole table set (deploy.follow6's `writing`), as after any failed follow.
            self.error = f"IPv6 lazy rebuild: {e}"
            self.f.log(self.error)
            try:
                self.fail_safe()
            except (HypafilterError, OSError):
                pass
            return
        if not self.hold():
            self.release()

    def new_program(self, v6: ip6.V6Policy, rebuild: bool = True, live6: str | None = None) -> None:
        """The IPv6 tables outgrew the running program: a new one for the deployed IPv4 policy and `v6`
        (deploy.follow(rebuild=True): make-before-break, the IPv4 side shunted meanwhile, the new program held
        from its start while the IPv6 hold is in force). `rebuild` False: an update as any follow's (the emulated
        NIC's core: register writes when its IPv6 matcher is the new plan's, else a new core)."""
        f = self.f
        st = f.state()
        cfg = deploy.deployed_config(st)
        text, _ = live.listing(f.ns, cfg.table, f.nft.generation)
        policy = live.live_policy(text, st, cfg)
        f.in_follow, f.released = True, False
        try:
            new = deploy.follow(policy, f.log, rebuild=rebuild, watch=f, abort=f.stopping, v6=v6, live6=live6)
        finally:
            f.in_follow = False
            f.applying = None
        f.state()
        if new.get("held"):
            f.safe = True  # an IPv4 change came meanwhile: the next round applies it

    def doc(self) -> dict:
        return {
            "mode": self.mode(),
            "following": not self.error,
            "error": self.error,
            "safe": self.safe,
            "nft_generation": self.generation,
            **self.counts,
            "last_how": self.last_how,
            "lag_safe_ms": live.percentiles(self.lag_safe),
            "lag_apply_ms": live.percentiles(self.lag_apply),
        }

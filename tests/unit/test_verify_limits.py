"""Which rate limits and timed lists verify compares, and the conditions it checks after a run (ops.verify:
neutral_rules, Limited, limit_condition; the system test is tests/system/test_verify_limits.py)."""

import pytest
from hypafilter.config import Config
from hypafilter.errors import HypafilterError
from hypafilter.iptables.document import parse_policy
from hypafilter.ops.verify import Limited, limit_condition, neutral_rules, refuse_nondeterministic, token_seconds

UFW_LOGGING = """*filter
:INPUT DROP [0:0]
:ufw-logging-deny - [0:0]
:ufw-not-local - [0:0]
:mixed - [0:0]
-A INPUT -m conntrack --ctstate INVALID -j ufw-logging-deny
-A INPUT -j ufw-not-local
-A INPUT -m limit --limit 3/min -j mixed
-A INPUT -p tcp --dport 22 -j ACCEPT
-A ufw-logging-deny -m conntrack --ctstate INVALID -m limit --limit 3/min --limit-burst 10 -j RETURN
-A ufw-logging-deny -m limit --limit 3/min --limit-burst 10 -j LOG --log-prefix "[UFW BLOCK] "
-A ufw-not-local -m addrtype --dst-type LOCAL -j RETURN
-A ufw-not-local -m limit --limit 3/min --limit-burst 10 -j ufw-logging-deny
-A ufw-not-local -j DROP
-A mixed -m limit --limit 1/s -j RETURN
-A mixed -p udp -j DROP
COMMIT
"""


def policy(text: str, chain: str = "INPUT"):
    return parse_policy(text, filename="l.rules", base_chain=chain, config=Config())


def test_neutral_rules():
    """LOG rules, a RETURN followed only by logging, a jump to a chain that only logs: neutral. A RETURN before a
    DROP, and the jump into that chain, decide verdicts."""
    pol = policy(UFW_LOGGING)
    from hypafilter.ops.verify import chains_of

    n = neutral_rules(chains_of(pol))
    assert {("ufw-logging-deny", 0), ("ufw-logging-deny", 1), ("ufw-not-local", 1), ("INPUT", 0)} <= n
    assert ("mixed", 0) not in n and ("INPUT", 2) not in n and ("ufw-not-local", 2) not in n
    # what verify checks after the run: the limits of `mixed` and of the jump into it, nothing of ufw's
    assert sorted((x.chain, x.index, x.burst, x.token) for x in refuse_nondeterministic(pol)) == [
        ("INPUT", 2, 5, 20.0),
        ("mixed", 0, 5, 1.0),
    ]


@pytest.mark.parametrize(
    ("rate", "seconds"),
    [("3/min", 20.0), ("3/minute", 20.0), ("10/sec", 0.1), ("10/s", 0.1), ("1/hour", 3600.0), ("2/day", 43200.0)],
)
def test_token_seconds(rate, seconds):
    assert token_seconds(rate) == pytest.approx(seconds)


def test_token_seconds_refuses_byte_rates():
    assert token_seconds("1kb/s") is None and token_seconds("0/s") is None


def test_hashlimit_forms():
    rule = "-p tcp -m hashlimit --hashlimit-{} --hashlimit-burst 4 --hashlimit-mode srcip --hashlimit-name h -j DROP"
    [above] = refuse_nondeterministic(
        policy(f"*filter\n:INPUT ACCEPT [0:0]\n-A INPUT {rule.format('above 2/min')}\nCOMMIT\n")
    )
    assert (above.upto, above.burst, above.token, above.expire, above.name) == (False, 4, 30.0, 10.0, "h")
    with pytest.raises(HypafilterError, match="verify refuses match 'hashlimit'"):
        refuse_nondeterministic(policy(f"*filter\n:INPUT ACCEPT [0:0]\n-A INPUT {rule.format('upto 1kb/s')}\nCOMMIT\n"))


def test_limit_condition():
    lim = Limited("p:3", "INPUT", 0, "limit", ("--limit", "3/min"), upto=True, last=True, burst=10, token=20.0)
    # a short run: the first `burst` pass, the rest are refused, whatever the clocks
    held, why = limit_condition(lim, 2.0, {"hybrid": 40, "oracle": 40})
    assert "one token's refill" in held and not why
    # a long run: within the burst still proves it, past it is no verdict
    assert limit_condition(lim, 30.0, {"hybrid": 9, "oracle": 9})[0]
    held, why = limit_condition(lim, 30.0, {"hybrid": 12, "oracle": 12})
    assert not held and "not under its burst" in why
    # a rule that never matched proves nothing wrong, whatever the run
    assert "no packet" in limit_condition(lim, 300.0, {"hybrid": 0, "oracle": 0})[0]
    timed = Limited("p:4", "INPUT", 1, "recent", ("--update", "--seconds", "30"), seconds=30, name="DEFAULT")
    assert limit_condition(timed, 5.0, {"hybrid": 3, "oracle": 3})[0]
    assert limit_condition(timed, 29.5, {"hybrid": 3, "oracle": 3})[1]

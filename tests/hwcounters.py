"""Test data: the core's hardware counters (CNT_* registers, hw/regmap.txt) as the dashboard reads them."""

from __future__ import annotations


def hw_counters(fwd=0, drop=0, over=0, pol=0, unp=0, forced=0, host=0, mirror=0) -> dict[str, int]:
    """Every CNT_* register with these values: frames forwarded, dropped, shunted per reason, from the host
    (the FIFO drop counter stays 0)."""
    return {
        "CNT_FORWARDED": fwd,
        "CNT_DROPPED": drop,
        "CNT_SHUNT_OVERRULE": over,
        "CNT_SHUNT_POLICY": pol,
        "CNT_SHUNT_UNPARSED": unp,
        "CNT_SHUNT_FORCED": forced,
        "CNT_FROM_HOST": host,
        "CNT_FIFO_DROP": 0,
        "CNT_MIRROR": mirror,
    }

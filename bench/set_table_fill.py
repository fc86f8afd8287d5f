"""How full the core's set table gets before the host's placement first refuses an element (hw.settable), for
random networks over a few prefix-length mixes and table geometries: the capacity figures of docs/hardware.md
("Set tables"). Usage: PYTHONPATH=mgmt python bench/set_table_fill.py [--seed N]"""

from __future__ import annotations

import argparse
import random
import time

from hypafilter.hw import settable
from hypafilter.hw.settable import Elem, Geometry, Image, TableFull

MIXES = {
    "6 lengths (16, 20, 24 x3, 28, 32)": (16, 20, 24, 24, 24, 28, 32),
    "hash:ip (32 only)": (32,),
    "16 lengths (17..32)": tuple(range(17, 33)),
}
GEOMETRIES = (settable.DEFAULT_GEOMETRY, Geometry(16, 10, 4), Geometry(16, 8, 8))


def fill(geom: Geometry, lengths: tuple[int, ...], seed: int) -> tuple[int, float]:
    rng, seen, img, n = random.Random(seed), set(), Image(0, "hash:net", geom), 0
    t0 = time.monotonic()
    while True:
        plen = rng.choice(lengths)
        a = rng.getrandbits(32) & settable.prefix_mask(plen)
        if (a, plen) in seen:
            continue
        seen.add((a, plen))
        try:
            img.insert(Elem(a, plen))
        except TableFull:
            return n, (time.monotonic() - t0) / max(n, 1)
        n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    print("| geometry (banks x buckets x ways) | cells | mix | placed before the first refusal | host µs/insert |")
    print("|---|---|---|---|---|")
    for geom in GEOMETRIES:
        for name, lengths in MIXES.items():
            n, per = fill(geom, lengths, args.seed)
            print(f"| {geom.banks} x {1 << geom.log2_buckets} x {geom.ways} | {geom.capacity:,} | {name} | "
                  f"{n:,} ({n / geom.capacity:.0%}) | {per * 1e6:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()

"""Renders the fast path for a Plan's shape (driver/xdp/fastpath.bpf.c.j2) and compiles it with clang -target bpf;
builds the loader (driver/xdp/hf_xdp.c). Objects are cached under <build_root>/xdp/<shape id>-<source hash>/."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import jinja2

from hypafilter import netns
from hypafilter.errors import HypafilterError
from hypafilter.paths import BUILD_ROOT, DRIVER_DIR, build_lock
from hypafilter.targets.xdp.tables import DIRECT_SIZE, SEARCH_FIELDS, shape_id

XDP_DIR = DRIVER_DIR / "xdp"
TEMPLATE = "fastpath.bpf.c.j2"
INCLUDED = (XDP_DIR / "hf_fastpath.h", DRIVER_DIR / "hypafilter_shared.h")


def render(shape: dict) -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(XDP_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template(TEMPLATE).render(
        fields=shape["fields"],
        search_fields=SEARCH_FIELDS,
        direct_size=DIRECT_SIZE,
        words=shape["words"],
        vec_cap=shape["vec_cap"],
        nb_cap=shape["nb_cap"],
        ent_cap=shape["ent_cap"],
        buf=shape.get("buf", 0),
        sets=shape.get("sets", []),
        v6=shape.get("v6"),  # a family-6 plan's table set (docs/ipv6.md "## xdp"); None: IPv6 frames unparsed
    )


def _arch_include() -> str:
    machine = subprocess.run(["cc", "-dumpmachine"], capture_output=True, text=True, check=True).stdout.strip()
    return f"/usr/include/{machine}"


def build_program(shape: dict, build_root: Path = BUILD_ROOT) -> Path:
    """fastpath.bpf.o for `shape`, compiled unless the cached source is the same text. The directory is named by the
    shape and the source: a program built from another template (its tables may mean something else, e.g. hfx_box's
    HFX_BOX_WILD bit) has another path, so deploy starts it instead of writing new tables into the running one."""
    text = render(shape)
    # The headers it includes are part of the source: a changed layout must rebuild a cached object.
    headers = "".join(f"// {h.name} {hashlib.sha256(h.read_bytes()).hexdigest()}\n" for h in INCLUDED)
    text = headers + text
    out = Path(build_root) / "xdp" / f"{shape_id(shape)}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    src, obj = out / "fastpath.bpf.c", out / "fastpath.bpf.o"
    # One compile per folder at a time (deploys of several labs may start the same program); every file is renamed
    # into place, so a loader reading the folder meanwhile sees the previous complete object or the new one.
    with build_lock(out / ".build.lock"):
        _write_atomic(out / "shape.json", json.dumps(shape, sort_keys=True) + "\n")
        if obj.exists() and src.exists() and src.read_text() == text:
            return obj
        _write_atomic(src, text)
        tmp = obj.with_name(f".{obj.name}.{os.getpid()}")
        argv = ["clang", "-O2", "-g", "-target", "bpf", "-Wall", f"-I{XDP_DIR}", f"-I{DRIVER_DIR}"]
        try:
            netns.run([*argv, f"-I{_arch_include()}", "-c", str(src), "-o", str(tmp)], timeout=None)
        except netns.CommandError as e:
            tmp.unlink(missing_ok=True)
            raise HypafilterError(f"compiling the XDP fast path failed: {e}") from e
        tmp.replace(obj)
    return obj


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def build_loader(build_root: Path = BUILD_ROOT) -> Path:
    out = (Path(build_root) / "xdp").resolve()
    try:
        with build_lock(out / ".loader.lock"):
            netns.run(["make", "-s", "-C", str(XDP_DIR), f"OUT={out}"], timeout=None)
    except netns.CommandError as e:
        raise HypafilterError(f"building the XDP loader failed: {e}") from e
    return out / "hf_xdp"

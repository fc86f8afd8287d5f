"""`hypafilter dashboard` started as an operator starts it, for the system tests that drive its API and page."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import need_tool


def deploy_example(example: Path):
    """rulesets/example.rules deployed on the emulated NIC of the lab deploy is pointed at: (policy, state)."""
    from hypafilter.config import Config
    from hypafilter.iptables.document import parse_policy
    from hypafilter.ops import deploy

    policy = parse_policy(example.read_text(), str(example), "FORWARD", Config())
    return policy, deploy.deploy(policy, Config(), force=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium():
    """Headless Chromium under chromedriver, as the dashboard's browser tests drive it (a profile of its own)."""
    need_tool("chromium", "chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tempfile.mkdtemp(prefix='hf-chromium-')}",
        "--window-size=1400,1500",
    ):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


@contextlib.contextmanager
def dashboard_server(lab: str, state_dir: str, log_path: Path, interval: float = 0.5) -> Iterator[str]:
    """The dashboard on a free loopback port, pointed at lab `lab` and its deploy state; yields its base URL once
    /healthz answers (the test fails with the server's log if it never does) and stops it afterwards."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    hf = str(Path(sys.executable).with_name("hypafilter"))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [hf, "dashboard", "--listen", f"127.0.0.1:{port}", "--interval", str(interval)],
            env=dict(os.environ, HF_LAB=lab, HF_STATE_DIR=state_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).json()["ok"]:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"dashboard did not come up: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        try:
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

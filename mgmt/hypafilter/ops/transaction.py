"""The all-or-nothing transaction of a deployment: steps with their undos, rolled back in reverse on any failure, with
per-step timings; `FAIL_ENV` makes a named step fail (the tests' failure injection)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hypafilter.errors import DeployError, HypafilterError

FAIL_ENV = "HF_FAIL_STEP"  # test hook: the named step fails (netfilter, netfilter6: a real (ip6)tables-restore error)


@dataclass
class Transaction:
    """Steps with their undos; a failure in any step rolls back every earlier one in reverse order."""

    log: Callable[[str], None] = lambda s: None
    undo: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    rollback_errors: list[str] = field(default_factory=list)

    def step(
        self, name: str, fn: Callable[[], object], undo: Callable[[], None] | None = None, undo_first: bool = False
    ) -> object:
        """Run one step. undo_first: the step can fail half-way (a run of register writes), so its undo is
        registered before it runs and a failure of the step itself also undoes it."""
        t = time.monotonic()
        self.log(f"{name} ...")
        if undo is not None and undo_first:
            self.undo.append((name, undo))
        try:
            if os.environ.get(FAIL_ENV) == name and name not in ("netfilter", "netfilter6"):
                raise HypafilterError(f"injected failure ({FAIL_ENV}={name})")
            result = fn()
        except DeployError:
            raise
        except (HypafilterError, OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
            raise DeployError(name, str(e)) from e
        finally:
            self.timings[name] = round(time.monotonic() - t, 4)
        if undo is not None and not undo_first:
            self.undo.append((name, undo))
        return result

    def rollback(self) -> None:
        for name, fn in reversed(self.undo):
            try:
                self.log(f"rollback {name}")
                fn()
            except Exception as e:  # keep undoing the rest; report every failure
                self.rollback_errors.append(f"{name}: {e}")
        self.undo.clear()

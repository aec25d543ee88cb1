"""A small process supervisor: the children of ``pagoda serve --disaggregated``.

It starts every child at once and polls them. A child that exits without being asked to (any exit
code, a signal included) is logged with its name and exit code and started again with the same
command line and environment, after a backoff; the other children keep running. Children inherit the
supervisor's stdout and stderr (no pipe that could fill up and block a child), so a crashed child's
traceback is already on stderr, just above the supervisor's line about it.

Restart policy (``RestartPolicy``, defaults in brackets):

* the first restart waits ``initial_backoff_s`` [1 s]; each further consecutive failure doubles the
  wait, up to ``max_backoff_s`` [30 s];
* a child that stayed up ``stable_after_s`` [60 s] before it exited starts a new series: its failure
  count and backoff are reset (so a crash now and then after serving for a while is always restarted);
* ``max_failures`` [5] consecutive failures of one child, each within ``stable_after_s`` of its start,
  mean it cannot start (bad flags, a port taken, not enough memory): the supervisor says so on stderr,
  stops the other children and exits 1 instead of looping forever.

SIGTERM or SIGINT to the supervisor stops the children stage by stage (``ChildSpec.stage``, lowest
first: the router drains before the workers it sends to): SIGTERM, which makes a server drain
(node_agent/serving/api/drain.py), then SIGKILL after ``stop_timeout_s`` [10 s; ``pagoda serve
--disaggregated`` sets --drain-timeout + 10 s]; ``run`` returns 0. A second SIGTERM or SIGINT kills
the children at once. Children run in their own session (a terminal's Ctrl-C reaches only the
supervisor, which stops them in order) and, on Linux, get SIGTERM if the supervisor itself dies.
"""

from __future__ import annotations

import ctypes
import logging
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from pagoda.node_agent.serving.api.internal_auth import TOKEN_ENV as INTERNAL_TOKEN_ENV
from pagoda.node_agent.serving.api.internal_auth import TOKEN_FILE_ENV as INTERNAL_TOKEN_FILE_ENV
from pagoda.node_agent.serving.launch import stop

log = logging.getLogger("pagoda.supervisor")

TENANT_SECRET_ENV = "PAGODA_TENANT_SECRET"
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


@dataclass
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    max_failures: int = 5
    stop_timeout_s: float = 10.0
    poll_s: float = 0.2

    def backoff(self, failures: int) -> float:
        """The wait before restarting a child that has failed ``failures`` (>= 1) times in a row."""
        return min(self.initial_backoff_s * 2 ** (failures - 1), self.max_backoff_s)


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    stage: int = 0  # stop order: lower stages are stopped (and drained) first


@dataclass
class Restart:
    """One restart: which child, how it exited, after which wait, the how-many-th in a row."""

    name: str
    exit_code: int
    delay_s: float
    failures: int


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    last_code: int = 0


@dataclass
class Supervisor:
    """Runs ``children`` until stopped or one of them cannot start (see the module docstring)."""

    children: list[ChildSpec]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    env: Mapping[str, str] | None = None
    ready: Callable[[], bool] | None = None  # polled until True, then ``ready_line`` is printed
    ready_line: str = "ready"
    label: str = "pagoda supervisor"
    out: TextIO = field(default_factory=lambda: sys.stdout)
    restarts: list[Restart] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._hurry = threading.Event()  # a second stop request: kill the children at once
        self._state = [_Child(s) for s in self.children]

    def request_stop(self) -> None:
        """Stop every child and make ``run`` return 0 (safe from a signal handler or another thread);
        a second request kills the children still running at once."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    def pids(self) -> dict[str, int]:
        return {c.spec.name: c.proc.pid for c in self._state if c.proc is not None and c.proc.poll() is None}

    def run(self) -> int:
        """Start the children and supervise them: 0 once stopped, 1 when a child keeps failing."""
        restore = self._install_signals()
        try:
            for c in self._state:
                self._start(c)
            announced = self.ready is None
            if announced:
                self._say(self.ready_line)
            while not self._stop.is_set():
                now = time.monotonic()
                for c in self._state:
                    if not self._check(c, now):
                        return 1
                if not announced and self.ready is not None and self.ready():
                    announced = True
                    self._say(self.ready_line)
                self._stop.wait(self.policy.poll_s)
            return 0
        finally:
            for stage in sorted({c.spec.stage for c in self._state}):
                procs = [c.proc for c in self._state if c.proc is not None and c.spec.stage == stage]
                stop(procs, timeout=self.policy.stop_timeout_s, hurry=self._hurry)
            restore()

    def _check(self, c: _Child, now: float) -> bool:
        """Notice an exit, or restart when its backoff is over; False: give up."""
        if c.restart_at is not None:
            if now >= c.restart_at and not self._stop.is_set():
                c.restart_at = None
                self._start(c)
                pid = c.proc.pid if c.proc else "?"
                self._say(
                    f"restarted {c.spec.name} (pid {pid}) after it exited with code {c.last_code} "
                    f"(failure {c.failures} in a row)"
                )
            return True
        if c.proc is None or c.proc.poll() is None:
            return True
        code = c.proc.returncode
        uptime = now - c.started_at
        if uptime >= self.policy.stable_after_s:
            c.failures = 0
        c.failures += 1
        c.last_code = code
        if c.failures >= self.policy.max_failures:
            print(
                f"{self.label}: {c.spec.name} exited with code {code}; it failed {c.failures} times in a "
                f"row, each within {self.policy.stable_after_s:g}s of starting: giving up (its errors are "
                "above)",
                file=sys.stderr,
                flush=True,
            )
            return False
        delay = self.policy.backoff(c.failures)
        log.warning(
            "%s exited with code %s after %.1fs; restarting it in %gs", c.spec.name, code, uptime, delay
        )
        self.restarts.append(Restart(c.spec.name, code, delay, c.failures))
        c.restart_at = now + delay
        return True

    def _start(self, c: _Child) -> None:
        c.proc = subprocess.Popen(
            c.spec.argv,
            env=dict(self.env) if self.env is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if _LIBC is not None else None,
        )
        c.started_at = time.monotonic()

    def _say(self, line: str) -> None:
        print(f"{self.label}: {line}", file=self.out, flush=True)

    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in old:
            signal.signal(s, lambda signum, frame: self.request_stop())

        def restore() -> None:
            for s, h in old.items():
                signal.signal(s, h)

        return restore


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies (Linux ``PR_SET_PDEATHSIG``)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def child_env(
    environ: Mapping[str, str], internal_token_file: str | None, tenant_secret: str | None
) -> dict[str, str]:
    """The children's environment: shared secrets travel here, never on a command line.

    The internal token comes from the user (``--internal-token-file``, ``$PAGODA_INTERNAL_TOKEN_FILE``
    or ``$PAGODA_INTERNAL_TOKEN``, inherited as is) or is generated fresh. The tenant secret comes
    from ``--tenant-secret``, else ``$PAGODA_TENANT_SECRET``, else is generated once here, so that a
    restarted child salts the prefix cache like its predecessor.
    """
    env = dict(environ)
    if not (internal_token_file or env.get(INTERNAL_TOKEN_FILE_ENV) or env.get(INTERNAL_TOKEN_ENV)):
        env[INTERNAL_TOKEN_ENV] = secrets.token_urlsafe(32)
    if tenant_secret:
        env[TENANT_SECRET_ENV] = tenant_secret
    elif not env.get(TENANT_SECRET_ENV):
        env[TENANT_SECRET_ENV] = secrets.token_urlsafe(32)
    return env

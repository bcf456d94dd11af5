"""Claims on one step of a relay (push run R, hand over run R), visible on Kaggle to every orchestrator.

Two orchestrators can share a relay without sharing anything but Kaggle (a GitHub Actions tick beside a
Prefect schedule, a laptop beside both). Kaggle offers no lock, conditional write or idempotency key: a
SaveKernel always makes a new version and a CreateDatasetVersion always makes a new version. It offers one
atomic create-if-absent: a dataset slug is unique per owner, and CreateDataset of a slug that exists is
refused ("... is already in use"). A claim is a one-file private dataset `<owner>/<relay>-lease-<key hash>-g<N>`
whose description (written by that same CreateDataset) names the holder and the expiry:
- take: create generation 1; refused means someone else's: read it back. A live claim of another holder:
  back off until it expires. An expired one: create generation N+1 (again atomic: of two takers one wins).
- read back after creating (a lost response then a retried create is "already in use" but ours);
- before each act (the push, each publish) the holder confirms: no generation N+1 exists and at least half the
  lease is left (a taker waits for the whole lease), so its act lands before anyone may take over.
A claim whose step took effect (a pushed run id, a published checkpoint) is kept until it expires: the effect
is what every next observation sees, so nobody asks for that claim again, and an orchestrator that observed
before the effect backs off instead of downloading the output again. A claim whose step did not take effect
(a refused push, a failed hand-over, a relay that stopped) is released when its process leaves the flow: a
second version of the claim dataset whose notes say so; it then reads as expired. A killed holder releases
nothing: another machine's step waits for the lease, at most. On the holder's own machine (the user's next
`relay run` after a Ctrl-C or a SIGKILL) it is taken over at once: the claim also names the holder's machine
(host, boot, pid namespace) and its process's start time, and a process of this machine with that pid and start
time that no longer exists acts no more (a pid reused since has another start time).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

from relay.orchestrator.kaggle.types import KaggleError

if TYPE_CHECKING:
    from relay.orchestrator.kaggle.backend import KaggleBackend

log = logging.getLogger(__name__)
PREFIX = "relay-lease:"
RELEASED = "relay-lease-released"  # in a claim's later version notes: its holder is done without effect
_HOLDER: Dict[str, object] = {}    # this process's holder name, and the pid it was made in


def this_process() -> str:
    """The holder this process is: a retried tick job, a second flow process, a process forked from another (a
    fork server's child shares its parent's imported modules) are each another orchestrator."""
    pid = os.getpid()
    if _HOLDER.get("pid") != pid:
        _HOLDER.update(pid=pid, name=f"{socket.gethostname()[:24]}:{pid}:{secrets.token_hex(3)}")
    return str(_HOLDER["name"])


@functools.cache  # none of the three changes while a process lives: /proc is read once
def this_machine() -> str:
    """Where a pid means the same process: the host, its boot (pids restart at each) and the pid namespace (two
    containers of one host with one hostname do not see each other's pids). Empty where it cannot be told."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: no way to tell this machine's boots apart, so never judge a pid (the lease
        return ""      # runs out as it does across machines); the orchestrator needs nothing beyond the stdlib
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}|{boot}|{namespace}"


UNKNOWN_START = -1.0  # the process lives; when it started cannot be told here


def process_started(pid: int) -> Optional[float]:
    """When the process started (Linux: seconds after boot, from /proc), None when no such
    process lives (a zombie acts no more either), UNKNOWN_START when it lives but its start cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
        return None if fields[0] in ("Z", "X") else int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
    except (OSError, ValueError, IndexError):
        return UNKNOWN_START
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass
    return UNKNOWN_START


def this_process_identity() -> Tuple[int, float]:
    pid = os.getpid()
    return pid, float(process_started(pid) or UNKNOWN_START)


@dataclass(frozen=True)
class Claim:
    key: str
    generation: int
    holder: str
    expires: float  # unix time, by the holder's clock
    machine: str = ""               # the holder's this_machine(); "" for a claim that does not say
    pid: Optional[int] = None       # the holder's process and its start time on that machine
    started: Optional[float] = None

    def holder_gone(self) -> bool:
        """The holder is a process of this machine that no longer exists (its pid is free, or reused since by a
        process started at another time). False whenever that cannot be told: another machine's claim, a claim
        that does not name its process, a process we may not inspect."""
        if not self.machine or self.pid is None or self.machine != this_machine():
            return False
        started = process_started(self.pid)
        if started is None:
            return True
        # a live pid is the holder unless both start times are known and differ (reused since)
        return self.started is not None and self.started >= 0 and started >= 0 and abs(started - self.started) > 1.0

    def text(self) -> str:
        until = datetime.fromtimestamp(self.expires, timezone.utc).strftime("%H:%M:%S UTC")
        return f"{self.key} is claimed by {self.holder} until {until}"


class LeaseBusy(Exception):
    """Another orchestrator holds the step (or our own claim is too close to its end to act on)."""

    def __init__(self, claim: Claim):
        super().__init__(f"another orchestrator is on it: {claim.text()}")
        self.claim = claim


class LeaseLost(Exception):
    """The claim was taken over (its holder stalled past the lease): stop before acting."""


class NotALease(KaggleError):
    """A dataset that is not a claim sits where one goes: a person must move it."""


class Lease:
    def __init__(self, backend: "KaggleBackend", relay_name: str, ttl_s: float, holder: Optional[str] = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time,
                 process: Optional[Tuple[int, float]] = None):
        self.backend, self.owner = backend, backend.username
        self.name, self.ttl_s, self.holder = relay_name, float(ttl_s), holder or this_process()
        # (pid, start time) written into our claims so that our machine can tell when we are gone; a holder
        # named by the caller is no process of ours unless `process` says which
        self.process = process if process is not None else (None if holder else this_process_identity())
        self.sleep, self.clock = sleep, clock  # the wall clock: expiries are unix times, shared by all holders
        self._newest: Dict[str, int] = {}  # key -> newest generation seen (probing starts there)
        self._open: Dict[str, Claim] = {}   # claims taken whose step has not taken effect (yet)

    def slug(self, key: str, generation: int) -> str:
        digest = hashlib.sha256(f"{self.name}/{key}".encode()).hexdigest()[:10]
        return f"{self.name[:22].rstrip('-')}-lease-{digest}-g{generation}"

    # -- the protocol ----------------------------------------------------------------------------
    def acquire(self, key: str) -> Claim:
        """Our claim on `key` with at least half the lease left; LeaseBusy while someone else's is live."""
        generation = self._newest.get(key, 1)
        while True:
            claim = self._read(key, generation)
            if claim is None:
                self._create(key, generation)
                claim = self._read(key, generation)  # read back: whose it is, whoever's create landed
                if claim is None:
                    raise KaggleError(f"lease {self.slug(key, generation)}: created but not readable yet")
            if self._read(key, generation + 1) is not None:
                generation += 1  # taken over already: look at the newer one
                continue
            self._newest[key] = generation
            left = claim.expires - self.clock()
            if claim.holder == self.holder and left >= self.ttl_s / 2:
                self._open[key] = claim
                return claim
            if left > 0 and claim.holder != self.holder and claim.holder_gone():
                log.warning("%s, a process of this machine that no longer exists: taking it over now, %.0f s"
                            " before it ends", claim.text(), left)
            elif left > 0:
                raise LeaseBusy(claim)
            generation += 1  # expired, or its holder gone (ours or a dead holder's): the next generation, atomically

    def confirm(self, claim: Claim) -> Claim:
        """Right before an act: still ours, not taken over, enough time left for the act to land. Near its end
        our own claim is renewed the only safe way: let it expire, then take the next generation."""
        if self._read(claim.key, claim.generation + 1) is not None:
            raise LeaseLost(f"{claim.key}: taken over by another orchestrator (generation {claim.generation + 1})")
        left = claim.expires - self.clock()
        if left >= self.ttl_s / 2:
            return claim
        if left > 0:
            log.info("lease on %s ends in %.0f s: renewing it once it has expired", claim.key, left)
            self.sleep(left + 0.05)
        try:
            renewed = self.acquire(claim.key)
        except LeaseBusy as busy:
            raise LeaseLost(f"{claim.key}: taken over while ours expired ({busy.claim.text()})") from None
        if renewed.generation <= claim.generation:
            raise LeaseLost(f"{claim.key}: not renewed")
        return renewed

    def took_effect(self, key: str) -> None:
        """The step's effect is on Kaggle: keep the claim until it expires (see the module's docstring)."""
        self._open.pop(key, None)

    def release_open(self) -> None:
        """Release every claim of this Lease whose step did not take effect, so that another process (the next
        tick, the user's next `relay run`) need not wait for the lease. Best effort: expiry is the fallback."""
        for key, claim in list(self._open.items()):
            ref = f"{self.owner}/{self.slug(key, claim.generation)}"
            try:
                info = self.backend.dataset_info(ref) or {}  # its description as created: the claim stays readable
                self.backend.new_dataset_version(ref, self._title(key, claim.generation), info.get("description", ""),
                                                 {"lease.json": json.dumps({"key": key, "released_by": self.holder})},
                                                 notes=f"{RELEASED} by {self.holder}")
                self._open.pop(key, None)
            except Exception as err:  # noqa: BLE001
                log.warning("could not release the claim on %s (%s); it lapses at its expiry", key, err)

    def guard(self, claim: Claim) -> Callable[[], None]:
        """A check to run before each act of a multi-act step (the hand-over's publications)."""
        held = [claim]

        def check() -> None:
            held[0] = self.confirm(held[0])
        return check

    # -- Kaggle ----------------------------------------------------------------------------------
    def _read(self, key: str, generation: int) -> Optional[Claim]:
        ref = f"{self.owner}/{self.slug(key, generation)}"
        info = self.backend.dataset_info(ref)  # None when absent
        if info is None:
            return None
        text = info["description"]
        try:
            data = json.loads(text[text.index(PREFIX) + len(PREFIX):].strip())
            released = any(RELEASED in notes for notes in info["notes"].values())
            pid, started = data.get("pid"), data.get("started")
            return Claim(key, generation, str(data["holder"]), 0.0 if released else float(data["expires"]),
                         machine=str(data.get("machine") or ""), pid=None if pid is None else int(pid),
                         started=None if started is None else float(started))
        except (ValueError, KeyError, TypeError):
            raise NotALease(f"dataset {ref} is not a relay lease (its description carries none): delete it"
                            " or rename the relay") from None

    def _create(self, key: str, generation: int) -> bool:
        """CreateDataset of the claim: True when it was created, False when the slug was taken (by anyone)."""
        data = {"key": key, "holder": self.holder, "expires": round(self.clock() + self.ttl_s, 3), "relay": self.name}
        if self.process is not None and this_machine():
            data.update(machine=this_machine(), pid=self.process[0], started=round(self.process[1], 3))
        description = (f"A claim of kaggle-relay {self.name} (see docs/kaggle.md). {PREFIX}"
                       f"{json.dumps(data, sort_keys=True)}")
        return self.backend.create_dataset_if_absent(f"{self.owner}/{self.slug(key, generation)}",
                                                     self._title(key, generation), description,
                                                     {"lease.json": json.dumps(data)})

    def _title(self, key: str, generation: int) -> str:
        return f"relay lease {self.slug(key, generation)[-18:]}"

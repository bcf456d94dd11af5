"""The relay's decision, as a pure function of what Kaggle shows.

The orchestrator keeps no state of its own. Each tick it observes two things on Kaggle: the checkpoint
dataset's latest progress.json (what has been handed over) and the session kernel's current version (its
run id, read back from the pushed source, and its status). Run ids encode the session number and the
attempt (`price-tiny-s003-a1`), so from those two observations alone it knows whether the kernel's run
is still going, finished and not yet handed over, failed, or already handed over, and what to do next.
Kill the orchestrator anywhere and the next tick sees the same facts and makes the same decision.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace
from typing import Optional, Protocol, Tuple

from relay.orchestrator.relay_state import State
from relay.shared import progress_line
from relay.shared.progress import Progress

_RUN_ID = re.compile(r"^(?P<name>[a-z0-9][a-z0-9-]*)-s(?P<session>\d{3,})-a(?P<attempt>\d+)$")


def run_id(name: str, session: int, attempt: int) -> str:
    return f"{name}-s{session:03d}-a{attempt}"


def parse_run_id(value: Optional[str]) -> Optional[tuple[int, int]]:
    """(session, attempt) of a relay run id, None for anything else (e.g. a kernel pushed by hand)."""
    m = _RUN_ID.match(value or "")
    return (int(m["session"]), int(m["attempt"])) if m else None


@dataclass(frozen=True)
class Names:
    """Where one relay lives on Kaggle. All derived from the owner and the spec name."""

    owner: str
    name: str

    @property
    def kernel(self) -> str:
        return f"{self.owner}/{self.name}-session"

    @property
    def checkpoint_dataset(self) -> str:
        return f"{self.owner}/{self.name}-ckpt"

    @property
    def features_dataset(self) -> str:
        return f"{self.owner}/{self.name}-features"

    @property
    def model_dataset(self) -> str:
        return f"{self.owner}/{self.name}-model"

    def links(self, emulator: Optional[str] = None) -> str:
        """Markdown links to these places: the session kernel and its log, the checkpoint and the final model
        datasets; against an emulator (its URL) a note of where they are instead."""
        kernel, ckpt, model = self.kernel, self.checkpoint_dataset, self.model_dataset
        if emulator:
            return (f"on the local Kaggle emulator at {emulator} (not kaggle.com): kernel `{kernel}`, checkpoints"
                    f" `{ckpt}`, final model `{model}`")
        code, data = "https://www.kaggle.com/code", "https://www.kaggle.com/datasets"
        return (f"on Kaggle: [session kernel]({code}/{kernel}), [its log]({code}/{kernel}/log),"
                f" [checkpoints]({data}/{ckpt}), [final model]({data}/{model})")


@dataclass(frozen=True)
class Observation:
    published: Optional[Progress]  # progress.json of the checkpoint dataset's latest version; None before
    kernel_run: Optional[str]      # run id in the kernel's current version; None if never pushed
    kernel_state: Optional[str]    # "queued" | "running" | "complete" | "error" | "cancelled" | None
    failure_message: str = ""
    features_published: bool = False
    # the user's say (relay/orchestrator/kaggle/control_record.py): who stopped the relay with `relay stop`, when and
    # why ("" while it is not stopped); the session whose kernel `relay stop --now` deleted (its run id), if any
    stopped_by_user: str = ""
    ended_by_user: Optional[str] = None
    # the wedged session whose kernel the relay deleted (its run id, recorded on Kaggle before the delete): after a
    # delete Kaggle can refuse pushes for a while (kaggle-cli #185), and the retry must not reuse the deleted run id
    deleted_run: Optional[str] = None
    deleted_charges: tuple = ()  # the failed attempts' charges recorded with it, for its retry's push
    # the kernel version that carries kernel_run: the state and the output are read for this version only
    # (versionLabel "v<N>"), never for "the latest", which lags a push; None: not known yet ("starting")
    kernel_version: Optional[int] = None
    # while the kernel runs: the unix time past which Kaggle should have ended it (its push, the timeout the push
    # asked for, and kaggle.startup_overhead more), None when unknown; and when this observation was made
    deadline: Optional[float] = None
    observed_at: float = 0.0

    def __post_init__(self) -> None:  # the document as read from Kaggle, or a parsed one (tests, old callers)
        object.__setattr__(self, "published", Progress.read(self.published, "the published progress.json"))

    @property
    def published_step(self) -> int:
        """The step of the published checkpoint (0 before the first hand-over)."""
        return self.published.global_step if self.published else 0

    @property
    def handed_over(self) -> int:
        """Sessions whose checkpoint is published (the session number in the published run id)."""
        parsed = parse_run_id(self.published.run_id if self.published else None)
        return parsed[0] if parsed else 0


class Do(str, enum.Enum):
    PUSH = "push"          # push session `session`, attempt `attempt`
    WAIT = "wait"          # the kernel is queued or running
    HARVEST = "harvest"    # the kernel finished: download, verify, publish the checkpoint
    SALVAGE = "salvage"    # the kernel failed: hand over what it saved if it advanced, else retry
    WEDGED = "wedged"      # Kaggle reports the kernel running past its deadline: per kaggle.on_wedged (on_wedged)
    # the decisions that leave the relay in one of its states say it in the states' words (relay_state.State),
    # not a second list of them: `state` is that State
    DONE = State.DONE.value
    FAILED = State.FAILED.value
    # after a hand-over only (after_handover): the checkpoint is published, look again; or the session refused a
    # corrupt mounted checkpoint version, make the newest valid one current again (relay/orchestrator/restore.py)
    HANDED_OVER = State.HANDED_OVER.value
    RESTORE = "restore"
    STOPPED = State.STOPPED.value  # `relay stop`: nothing more is pushed until `relay resume` (unless_stopped)

    @property
    def state(self) -> Optional[State]:
        """The relay's state this decision is (done, failed, handed over, stopped); None for an action to take."""
        return State(self.value) if self in _STATES else None


_STATES = frozenset({Do.DONE, Do.FAILED, Do.HANDED_OVER, Do.STOPPED})


@dataclass(frozen=True)
class Action:
    do: Do
    run_id: Optional[str] = None
    session: int = 0
    attempt: int = 0
    reason: str = ""
    failed: str = ""  # set by after_handover when the session failed: the one line a person is told


def decide(name: str, obs: Observation) -> Action:
    """The one next step of the relay; no push while the user has it stopped (unless_stopped)."""
    return unless_stopped(name, obs, _next_step(name, obs))


def unless_stopped(name: str, obs: Observation, action: Action) -> Action:
    """STOPPED instead of a push while the relay is stopped by the user (`relay stop`); a running session is still
    waited for and handed over as usual."""
    if action.do is not Do.PUSH or not obs.stopped_by_user:
        return action
    step = obs.published_step
    return Action(Do.STOPPED, session=action.session, attempt=action.attempt,
                  reason=f"stopped by the user (relay stop) at step {step}, {obs.stopped_by_user}; `relay resume"
                         f" {name}` to go on")


def _next_step(name: str, obs: Observation) -> Action:
    if obs.published is not None and obs.published.status == "done":
        return Action(Do.DONE, reason="the published checkpoint says the work is done")
    next_session = obs.handed_over + 1
    parsed = parse_run_id(obs.kernel_run)
    if parsed is None or parsed[0] < next_session:
        # Nothing pushed yet, or the kernel's run is already handed over: start the next session.
        deleted = _deleted_attempt(obs, next_session)
        if deleted is not None:
            # `relay stop --now`, or the wedge recovery, deleted this session's kernel: a new attempt from the last
            # published checkpoint (a new run id: the deleted one's claims on Kaggle stand until they expire)
            ended, why = deleted
            return Action(Do.PUSH, run_id(name, next_session, ended + 1), next_session, ended + 1, why)
        return Action(Do.PUSH, run_id(name, next_session, 1), next_session, 1, "next session")
    session, attempt = parsed
    restored = (obs.published.restored if obs.published else None) or {}
    if session >= next_session and restored.get("after_run") == obs.kernel_run:
        # a bad checkpoint version was replaced by an older valid one (relay/orchestrator/restore.py): redo from there
        attempt = int(restored.get("attempt", 1))
        return Action(Do.PUSH, run_id(name, next_session, attempt), next_session, attempt,
                      f"checkpoint v{restored.get('bad_version')} was bad; resuming from the restored"
                      f" v{restored.get('from_version')}")
    if session > next_session:
        return Action(Do.FAILED, obs.kernel_run, session, attempt,
                      f"the kernel runs session {session} but only {obs.handed_over} are handed over:"
                      " the checkpoint dataset was changed by hand")
    if obs.kernel_state == "running" and obs.deadline is not None and obs.observed_at > obs.deadline:
        return Action(Do.WEDGED, obs.kernel_run, session, attempt,
                      f"session {session} ({obs.kernel_run}) is still reported running"
                      f" {obs.observed_at - obs.deadline:.0f} s past its deadline: wedged")
    if obs.kernel_state in (None, "queued", "running", "new_script"):
        return Action(Do.WAIT, obs.kernel_run, session, attempt, f"kernel is {obs.kernel_state or 'starting'}")
    if obs.kernel_state == "complete":
        return Action(Do.HARVEST, obs.kernel_run, session, attempt, "kernel complete")
    if hit_session_limit(obs.kernel_state, obs.failure_message):
        return Action(Do.SALVAGE, obs.kernel_run, session, attempt,
                      f"kernel stopped at Kaggle's session limit: {obs.failure_message}")
    return Action(Do.SALVAGE, obs.kernel_run, session, attempt,
                  f"kernel {obs.kernel_state}: {obs.failure_message}".rstrip(": "))


def _deleted_attempt(obs: Observation, next_session: int) -> Optional[Tuple[int, str]]:
    """(attempt, why) of the newest attempt of `next_session` whose kernel was deleted (by `relay stop --now` or
    the wedge recovery), None when none was; only while the kernel is absent (deleted, nothing pushed since)."""
    if obs.kernel_run is not None:
        return None
    found = []
    for run, why in ((obs.ended_by_user, "was ended by the user (relay stop --now)"),
                     (obs.deleted_run, "was wedged and its kernel deleted")):
        parsed = parse_run_id(run)
        if parsed is not None and parsed[0] == next_session:
            found.append((parsed[1], f"{run} {why}"))
    return max(found) if found else None


# A batch run past the session limit ends CANCEL_ACKNOWLEDGED with this message (Kaggle's own wording).
SESSION_LIMIT_MESSAGE = "exceeded the max allowed execution duration"


def hit_session_limit(state: Optional[str], failure_message: str) -> bool:
    """Kaggle stopped the session at its maximum duration: the budget was set too long for the session (or
    the start-up took longer than `kaggle.startup_overhead`). Not transient: the same push would hit it again."""
    return state == "cancelled" and SESSION_LIMIT_MESSAGE in (failure_message or "").lower()


def session_limit_advice(session: int, budget_s: Optional[float], timeout_s: float, startup_s: float) -> str:
    """What to change after a session hit the limit (the relay's message and the plan say it)."""
    asked = f"a training budget of {budget_s:.0f} s" if budget_s else "its training budget"
    return (f"session {session} was stopped by Kaggle at its session limit ({SESSION_LIMIT_MESSAGE}): "
            f"{asked} plus start-up and the final save did not fit in kaggle.session_timeout {timeout_s:.0f} s. "
            f"A budget set too long, not a transient failure: lower session.budget or raise "
            f"kaggle.startup_overhead (now {startup_s:.0f} s), then run the relay again")


def on_wedged(wedged: Action, setting: str) -> Action:
    """kaggle.on_wedged: "delete" the wedged session's kernel (the WEDGED action itself: harvest what can be, delete,
    then after_wedge), or "wait" for Kaggle to end it (WAIT: a person was told and may delete it by hand)."""
    if setting == "wait":
        return replace(wedged, do=Do.WAIT, reason=f"{wedged.reason}; kaggle.on_wedged: wait: waiting for Kaggle"
                                                  " to end it")
    return wedged


def after_wedge(name: str, wedged: Action, harvested: bool, max_attempts: int) -> Action:
    """After a wedged session's kernel was deleted: HANDED_OVER when its output could be harvested, else the same
    session again from the last published checkpoint, a failed attempt (within kaggle.max_failed_sessions)."""
    if harvested:
        return replace(wedged, do=Do.HANDED_OVER, reason=f"{wedged.reason}; its output was handed over")
    then = retry_action(name, wedged, max_attempts, wedged.reason)
    return replace(then, failed=f"session {wedged.session} ({wedged.run_id}) failed: {wedged.reason}")


class HandOverResult(Protocol):
    """What after_handover reads of a hand-over (relay.orchestrator.handoff.HandOver)."""

    ok: bool
    reason: str
    step: int
    log_tail: str
    stale: bool


@dataclass(frozen=True)
class Recovery:
    """What the decision after a hand-over reads besides the hand-over: the spec's limits, and facts the
    orchestrator looked up on Kaggle when the hand-over failed."""

    max_attempts: int             # kaggle.max_failed_sessions + 1
    limit_advice: str = ""        # what to change after a session hit Kaggle's session limit
    lagging: bool = False         # the kernel's current version was pushed within kaggle.status_lag
    code_changed: bool = False    # a push now would ship other code or spec than the failed session's
    budget_lowered: bool = False  # the spec asks for a shorter session than the failed one was pushed with
    pushed: Optional[dict] = None  # the failed session's pushed plan, as read for the facts above


def after_handover(name: str, action: Action, result: HandOverResult, obs: Observation, facts: Recovery) -> Action:
    """The relay's next step once a finished session (HARVEST or SALVAGE `action`) was handed over, or not: look
    again (HANDED_OVER; WAIT for Kaggle's status lag), RESTORE a corrupt checkpoint version, PUSH a new attempt
    or a retry, or FAILED (a code error not fixed since, retries used up, a budget too long for the session
    limit). A failed session's next action carries `failed`, the line to tell a person."""
    def same(do: Do, why: str) -> Action:
        return Action(do, action.run_id, action.session, action.attempt, why)

    if not result.ok and result.stale and facts.lagging:
        # the lag's signature, not a failed session: even a pinned status/output may answer the previous version
        # for a while after a push; no new attempt
        return same(Do.WAIT, f"{result.reason} soon after its push: Kaggle's status lag; looking again")
    if hit_session_limit(obs.kernel_state, obs.failure_message) and (result.ok or not facts.budget_lowered):
        # not transient: the same budget would hit the limit again; what it saved is handed over
        saved = (f"Its checkpoint at step {result.step} is handed over." if result.ok else
                 f"Nothing was handed over ({result.reason}).")
        return same(Do.FAILED, f"{facts.limit_advice}. {saved}\n--- log tail ---\n{result.log_tail}")
    if result.ok:
        return same(Do.HANDED_OVER, f"handed over at step {result.step}")
    salvage = action.do is Do.SALVAGE
    corrupt = mounted_checkpoint_corrupt(result.log_tail) if salvage else None
    if corrupt:  # not the session's fault
        return same(Do.RESTORE, corrupt)
    ended = ended_itself(result.log_tail)  # stalled, or on another accelerator: a failed attempt, retried
    why = ended[1] if ended else result.reason
    code_error = looks_like_code_error(result.log_tail) if salvage and not ended else None
    if code_error and not facts.code_changed:
        then = same(Do.FAILED, f"session {action.session} failed with a code error: {code_error} (the code and"
                               " spec are unchanged since that push: fix them, then run the relay again)")
    elif code_error:  # a code error is pushed again only once the code or spec changed
        then = new_attempt(name, action, f"the code changed since: {code_error}")
    else:
        then = retry_action(name, action, facts.max_attempts, why)
    if then.do is Do.FAILED:
        then = replace(then, reason=f"{then.reason}\n--- log tail ---\n{result.log_tail}")
    return replace(then, failed=f"session {action.session} ({action.run_id}) failed: {code_error or why}")


def diverged_unchanged(obs: Observation, code_changed: bool) -> Optional[Action]:
    """Before a push: FAILED when the last session stopped itself on divergence and nothing was changed since."""
    published = obs.published
    if published is None or published.stop_reason != "diverged" or code_changed:
        return None
    last = published.last_session
    return Action(Do.FAILED, published.run_id, len(published.sessions), 0,
                  f"session {len(published.sessions)} stopped itself: {last.diverged if last else None}. Its"
                  f" checkpoint at step {published.global_step} is handed over. Change the spec or code"
                  " (learning rate, data) and run the relay again, or set session.stop_on_divergence: false to"
                  " train on")


def retry_action(name: str, failed: Action, max_attempts: int, why: str) -> Action:
    """After a failed or stale session: the same session again from the same checkpoint, or give up."""
    if failed.attempt >= max_attempts:
        return Action(Do.FAILED, failed.run_id, failed.session, failed.attempt,
                      f"session {failed.session} failed {failed.attempt} times; last: {why}")
    attempt = failed.attempt + 1
    return Action(Do.PUSH, run_id(name, failed.session, attempt), failed.session, attempt, f"retry: {why}")


def new_attempt(name: str, failed: Action, why: str) -> Action:
    """The same session again, from the same checkpoint, after the user changed the code or spec that failed:
    not a retry of a transient failure, so it does not count against kaggle.max_failed_sessions."""
    attempt = failed.attempt + 1
    return Action(Do.PUSH, run_id(name, failed.session, attempt), failed.session, attempt, why)


# A Python traceback ending in one of these is a bug in the code or the spec: retrying cannot help.
_CODE_ERRORS = re.compile(
    r"^(?:\w+\.)*(SyntaxError|IndentationError|ImportError|ModuleNotFoundError|NameError|TypeError|"
    r"AttributeError|KeyError|IndexError|AssertionError|NotImplementedError|InputError|SpecError|"
    r"NonFiniteLossError|DiskBudgetError|ValueError)\b", re.M)


# `relay train` reports an InputError (SpecError, DiskBudgetError, bad --data ...) as one line and exits 2,
# without a traceback: a bad spec or input, which the same session pushed again would hit again.
_CLI_ERROR = re.compile(r"^relay: error: .*$", re.M)


# `relay train` given --resume-from with nothing valid in it (relay.kernel.session.checkpoint.CorruptCheckpointError)
_CORRUPT_MOUNT = re.compile(r"^relay: error: the mounted checkpoint .* is corrupt: .*$", re.M)


def mounted_checkpoint_corrupt(log_tail: str) -> Optional[str]:
    """The session's one-line reason when it refused to start from a corrupt or partial checkpoint."""
    found = list(_CORRUPT_MOUNT.finditer(log_tail))
    return found[-1].group(0).removeprefix("relay: error: ") if found else None


# What a session that ended itself says in its last `relay-progress` line (kind "end"): a stall (the watchdog of
# session.stall_after; exit status 75, the newest checkpoint as it was) and another accelerator than the spec's
# kaggle.machine_shape under kaggle.on_other_accelerator: stop.
SELF_STOPS = ("stalled", "wrong_accelerator")


def ended_itself(log_tail: str) -> Optional[tuple[str, str]]:
    """(stop reason, why) when the session's log ends with it stopping itself: ("stalled", "stalled at step 5
    after 10m") or ("wrong_accelerator", "got 1 x Tesla P100-PCIE-16GB where ..."); None for any other end.
    Either is a failed attempt: retried from the same checkpoint within kaggle.max_failed_sessions
    (retry_action, with `why` as the reason), then the relay stops saying it."""
    for line in reversed(log_tail.splitlines()):
        record = progress_line.parse(line)
        if record is not None and record.get("kind") == "end":
            reason = record.get("stop_reason")
            return (reason, str(record.get("why") or reason)) if reason in SELF_STOPS else None
    return None


def looks_like_code_error(log_tail: str) -> Optional[str]:
    """The offending exception line if the log shows a code error, None when it looks transient
    (killed, timed out, CUDA/driver errors, lost connection)."""
    reported = list(_CLI_ERROR.finditer(log_tail))
    if reported:
        return reported[-1].group(0).strip()
    if "Traceback (most recent call last)" not in log_tail:
        return None
    matches = list(_CODE_ERRORS.finditer(log_tail))
    if not matches:
        return None
    line_end = log_tail.find("\n", matches[-1].start())
    return log_tail[matches[-1].start(): line_end if line_end >= 0 else None].strip()

"""The flow's view of the running session: follows its log (relay.orchestrator.live) and refreshes the artifacts, at most
every `curve_every_s` for the loss-curve image; early warnings go to the flow's log (and notifications)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from prefect import get_run_logger

from relay.orchestrator import handoff
from relay.orchestrator.live import LiveSession, early_warnings
from tasks import artifacts


class LiveView:
    def __init__(self, backend, names, local: Path, curve_every_s: float = 180.0,
                 stuck_after_s: float = 1800.0, notify: Callable[[str, str], None] = lambda key, text: None):
        self.backend, self.names, self.local = backend, names, local
        self.curve_every_s, self.stuck_after_s, self.notify = curve_every_s, stuck_after_s, notify
        self.live: Optional[LiveSession] = None
        self._artifact: Optional[str] = None
        self._curve_at = -float("inf")
        self._warned: set = set()

    def follow(self, run_id: str) -> LiveSession:
        """The follower of `run_id`'s session (a new one for a new run, or when the last stream ended empty:
        right after a push it can still be the previous version's log)."""
        if self.live is None or self.live.run_id != run_id or (self.live.ended and not self.live.records):
            self.live = LiveSession(self.backend, self.names.kernel, run_id).start()
            self._curve_at = -float("inf")  # a new session: its table row and curve at its first lines
        return self.live

    def refresh(self, progress: Optional[dict], kernel_state: str) -> None:
        live, logger = self.live, get_run_logger()
        if live is None:
            return
        records = list(live.records)
        speeds = [s.get("samples_per_s") for s in (progress or {}).get("sessions", []) if s.get("samples_per_s")]
        found = early_warnings(records, slow_below=sorted(speeds)[len(speeds) // 2] if speeds else None)
        if kernel_state == "running" and live.silent_for() > self.stuck_after_s:
            found.append(("stuck", f"no progress line for {live.silent_for() / 60:.0f} min (a stuck data loader"
                                   " or collective?)"))
        for key, text in found:
            if (live.run_id, key) not in self._warned:
                self._warned.add((live.run_id, key))
                logger.warning("early warning, %s: %s", live.run_id, text)
                self.notify(f"warning-{live.run_id}-{key}", f"{self.names.name} {live.run_id}: {text}")
        curves = time.monotonic() - self._curve_at >= self.curve_every_s
        try:  # the live view never fails a relay
            metrics = handoff.published_metrics(self.backend, self.names, self.local, progress) if progress else None
            self._artifact = artifacts.publish_live(self.names.name, progress, records, self.local, metrics,
                                                    self._artifact, curves, kernel_state, tuple(t for _, t in found))
        except Exception as err:  # noqa: BLE001
            logger.warning("live view of %s not refreshed: %s", live.run_id, err)
        if curves and records:
            self._curve_at = time.monotonic()

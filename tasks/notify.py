"""Telling a person, once each, through Prefect's own machinery: every relay event is a Prefect event
(`relay.session.failed`, `relay.session.wedged`, `relay.stopped`, `relay.finished`, `relay.quota-wait`,
`relay.warning` on the resource `relay.<name>`) that a server's automations can act on, and, when the spec names one (`notify.block`), a message
through that Prefect notification block (Slack, Teams, Discord, e-mail, a webhook: secrets stay in the block).
"Once" survives a killed orchestrator: the keys already told are kept in a Prefect Variable per relay."""
from __future__ import annotations

import json
from typing import Optional

from prefect import get_run_logger

from tasks.prefect_writes import soon

_KEEP = 500  # the newest keys told, per relay


class Notifier:
    def __init__(self, relay_name: str, block: Optional[str] = None):
        self.name, self.block = relay_name, block
        self._variable = f"relay-notified-{relay_name}"

    def __call__(self, kind: str, key: str, text: str, **payload) -> bool:
        """Tell `text` unless `key` was told before; True when it was told now."""
        from prefect.events import emit_event
        from prefect.variables import Variable

        told = json.loads(Variable.get(self._variable, default="[]"))
        if key in told:
            return False
        emit_event(event=f"relay.{kind}", resource={"prefect.resource.id": f"relay.{self.name}",
                                                    "prefect.resource.name": self.name},
                   payload={"key": key, "text": text, **payload})
        if self.block:
            from prefect.blocks.core import Block

            try:
                Block.load(self.block).notify(body=text, subject=f"relay {self.name}: {kind}")
            except Exception as err:  # noqa: BLE001 - a notification never fails the relay
                get_run_logger().warning("notify.block %s: %s", self.block, err)
                return False
        soon(lambda: Variable.set(self._variable, json.dumps((told + [key])[-_KEEP:]), overwrite=True))
        return True

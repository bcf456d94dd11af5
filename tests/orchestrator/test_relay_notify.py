"""Notifications through Prefect: a relay's events reach a person through a Prefect notification block (here a
CustomWebhookNotificationBlock pointing at a local HTTP receiver standing in for Slack/Teams/a webhook), each
once, also when the orchestrator is run again after it stopped (a restart sees the same facts)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import yaml

from byo_fixtures import CRASHING, FINISHING


class Receiver:
    """A webhook on 127.0.0.1 that keeps every JSON body posted to it."""

    def __init__(self):
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()


def _relay(relay_env, name: str, script: str, block: str) -> object:
    folder = relay_env.root / name
    folder.mkdir(exist_ok=True)
    (folder / "train.py").write_text(script)
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "code": {"folder": ".", "entry": "train.py"}, "optim": {"max_steps": 60},
        "session": {"threads": 1, "max_steps": 30, "safety_margin": "0.5s"}, "notify": {"block": block},
        "kaggle": {"session_timeout": "5m", "startup_overhead": "1s", "max_failed_sessions": 2}}))
    relay_env.spec = spec
    return spec


def _block(receiver, name: str) -> str:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    CustomWebhookNotificationBlock(name="relay-test", url=receiver.url, allow_private_urls=True,
                                   json_data={"subject": "{{subject}}", "body": "{{body}}"}).save(name, overwrite=True)
    return f"custom-webhook/{name}"


def test_a_stopped_relay_tells_once_even_when_run_again(relay_env, both_flows, monkeypatch,
                                                         receiver):
    import flows.one_relay as one_relay

    relay_env.start()
    name = f"crash-{both_flows}"  # what was told is kept per relay name on the (shared) Prefect server
    _relay(relay_env, name, CRASHING, _block(receiver, f"relay-hook-{name}"))
    for _ in range(2):  # the second run is a restarted orchestrator: it meets the same failure
        with pytest.raises(one_relay.RelayFailed):
            relay_env.run_flow(monkeypatch)
    subjects = [m["subject"] for m in receiver.received]
    assert subjects == [f"relay {name}: session.failed", f"relay {name}: stopped"], receiver.received
    assert f"{name}-s002-a1" in receiver.received[0]["body"] and "ValueError" in receiver.received[0]["body"]
    assert "stopped and needs you" in receiver.received[1]["body"] and "bad column" in receiver.received[1]["body"]
    from prefect.artifacts import Artifact

    stop = Artifact.get(f"{name}-summary")
    assert stop.data.startswith(f"# {name}: stopped, needs you\n\n**session 2 failed with a code error: relay: error")


def test_a_finished_relay_tells_once_with_where_the_model_is(relay_env, both_flows, monkeypatch, receiver):
    relay_env.start()
    name = f"done-{both_flows}"
    _relay(relay_env, name, FINISHING, _block(receiver, f"relay-hook-{name}"))
    assert relay_env.run_flow(monkeypatch)["state"] == "done"
    assert relay_env.run_flow(monkeypatch)["state"] == "done"  # run again: nothing new to tell
    assert [m["subject"] for m in receiver.received] == [f"relay {name}: finished"], receiver.received
    assert "finished at step 60" in receiver.received[0]["body"] and f"{name}-model" in receiver.received[0]["body"]

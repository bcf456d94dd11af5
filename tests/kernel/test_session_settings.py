"""What a user's loop is told (SessionSettings): the spec's defaults, written once; the JSON the relay passes
round-trips; scripts that read the settings by key keep working; an unknown setting is one clear error."""
from __future__ import annotations

import pytest

from relay.kernel.session.settings import SessionSettings
from relay.shared import spec as spec_mod
from relay.shared.errors import InputError


def test_the_defaults_are_the_specs_own(tmp_path):
    (tmp_path / "train.py").write_text("")  # the folder is the test's own: the checkout's size must not matter
    spec = spec_mod.validate({"name": "settings-test", "code": {"folder": str(tmp_path), "entry": "train.py"},
                              "optim": {"max_steps": 9}}, source="test")
    relayed = SessionSettings.from_spec(spec, "w")
    by_hand = SessionSettings(total_steps=9)
    for name in ("log_every", "save_every", "safety_margin", "stop_on_divergence", "keep_last", "disk_budget_gb",
                 "digest", "seed"):
        assert getattr(by_hand, name) == getattr(relayed, name), name


def test_the_json_round_trips_and_reads_by_key():
    settings = SessionSettings(total_steps=5, seed=3, resume_from=("a", "b"))
    back = SessionSettings.from_json(settings.to_json())
    assert back == settings and back["seed"] == 3 and back.get("missing", 7) == 7
    newer = SessionSettings.from_json({**settings.to_json(), "a_newer_relays_key": 1})  # a newer relay's kernel
    assert newer["a_newer_relays_key"] == 1 and newer.to_json()["a_newer_relays_key"] == 1
    with pytest.raises(KeyError):
        settings["extra"]


def test_open_session_names_an_unknown_setting(tmp_path, monkeypatch):
    import relay

    monkeypatch.delenv("RELAY_SESSION", raising=False)
    with pytest.raises(InputError, match=r"unknown setting\(s\) \['save_evry'\]"):
        relay.open_session(total_steps=3, workdir=str(tmp_path), save_evry=5)

"""Kaggle credentials from the places users keep them, held so they never reach a repr, log or file.

Order (the `kaggle` client's own, kagglesdk kaggle_env.get_access_token_from_env): an access token
(KAGGLE_API_TOKEN, a value or the path of a file holding it; else the file ~/.kaggle/access_token, or
~/.kaggle/access_token.txt, under HOME whatever KAGGLE_CONFIG_DIR says), then a legacy key (KAGGLE_USERNAME/
KAGGLE_KEY, then kaggle.json in KAGGLE_CONFIG_DIR or ~/.kaggle). The client asks Kaggle whose a token is; the
relay needs the username before its first call, so a token comes with KAGGLE_USERNAME (or kaggle.json's). A caller may pass its own
source instead: a `KaggleCredentials`, a dict, a JSON string, or any object with `.get()` (a Prefect Secret
block) or a callable returning one of those, so this package never imports Prefect.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from relay.shared.errors import InputError


@dataclass(frozen=True)
class KaggleCredentials:
    username: str
    key: Optional[str] = field(default=None, repr=False)
    token: Optional[str] = field(default=None, repr=False)
    source: str = field(default="", compare=False)  # where they were found (`relay doctor` says it)

    def __post_init__(self) -> None:
        if not self.username:
            raise InputError("Kaggle credentials: a username is required")
        if not (self.key or self.token):
            raise InputError(f"Kaggle credentials for {self.username!r}: need a key or an access token")

    @property
    def secrets(self) -> tuple:
        """The values that must never appear in a kernel, dataset, log line or artifact."""
        return tuple(s for s in (self.key, self.token) if s)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


def resolve(source: Any = None, env: Optional[Mapping[str, str]] = None,
            username: Optional[str] = None) -> KaggleCredentials:
    """Credentials from `source` if given, else from the environment and kaggle.json."""
    if source is not None:
        return _from_source(source, username)
    env = os.environ if env is None else env
    home = Path(env.get("HOME", "~")).expanduser()
    config_dir = Path(env.get("KAGGLE_CONFIG_DIR") or home / ".kaggle")
    kaggle_json = config_dir / "kaggle.json"
    token, where = _token(env, home)
    if token:
        user = username or env.get("KAGGLE_USERNAME") or _json_username(kaggle_json)
        if not user:
            raise InputError(f"{where} holds a Kaggle access token but no username comes with it: set"
                             " KAGGLE_USERNAME")
        return KaggleCredentials(user, token=token, source=where)
    if env.get("KAGGLE_USERNAME") and env.get("KAGGLE_KEY"):
        return KaggleCredentials(env["KAGGLE_USERNAME"], key=env["KAGGLE_KEY"], source="KAGGLE_USERNAME/KAGGLE_KEY")
    if kaggle_json.is_file():
        return _from_mapping(_parse_json(kaggle_json.read_text(), str(kaggle_json)), username, str(kaggle_json))
    raise InputError("no Kaggle credentials: set KAGGLE_API_TOKEN, KAGGLE_USERNAME/KAGGLE_KEY,"
                     f" or write {home / '.kaggle' / 'access_token'} or {kaggle_json}")


def _token(env: Mapping[str, str], home: Path) -> tuple:
    """(the access token, where it was found) as the client finds it, or (None, "")."""
    value = env.get("KAGGLE_API_TOKEN")
    if value:
        if not Path(value).exists():
            return value.strip(), "KAGGLE_API_TOKEN"
        token = Path(value).read_text().strip()
        if not token:
            raise InputError(f"KAGGLE_API_TOKEN names the file {value}, which is empty: expected the token in it")
        return token, f"KAGGLE_API_TOKEN ({value})"
    for path in (home / ".kaggle" / "access_token", home / ".kaggle" / "access_token.txt"):
        token = path.read_text().strip() if path.is_file() else ""
        if token:  # an empty file is passed over, as the client passes it over
            return token, str(path)
    return None, ""


def _json_username(path: Path) -> Optional[str]:
    if not path.is_file():
        return None
    return str(_parse_json(path.read_text(), str(path)).get("username") or "") or None


def _from_source(source: Any, username: Optional[str]) -> KaggleCredentials:
    if isinstance(source, KaggleCredentials):
        return source
    if hasattr(source, "get_secret_value"):  # pydantic SecretStr
        return _from_source(source.get_secret_value(), username)
    if callable(source) and not hasattr(source, "get"):
        return _from_source(source(), username)
    if hasattr(source, "get") and not isinstance(source, Mapping):
        return _from_source(source.get(), username)  # a Prefect Secret block: .get() returns the value
    if isinstance(source, Mapping):
        return _from_mapping(source, username)
    if isinstance(source, str):
        text = source.strip()
        if text.startswith("{"):
            return _from_mapping(_parse_json(text, "the secret"), username)
        if not username:
            raise InputError("a bare Kaggle access token needs a username")
        return KaggleCredentials(username, token=text)
    raise InputError(f"unsupported Kaggle credential source: {type(source).__name__}")


def _from_mapping(data: Mapping[str, Any], username: Optional[str], source: str = "") -> KaggleCredentials:
    user = data.get("username") or username
    return KaggleCredentials(str(user or ""), key=data.get("key") or None, token=data.get("token") or None,
                             source=source)


def _parse_json(text: str, where: str) -> dict:
    try:
        data = json.loads(text)
    except ValueError:
        raise InputError(f"{where}: not valid JSON (expected {{\"username\": ..., \"key\": ...}})") from None
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a JSON object with username and key")
    return data

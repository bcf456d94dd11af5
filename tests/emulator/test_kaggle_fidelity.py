"""The emulator answers as the public record says Kaggle does, through the real `kaggle` client, and the relay's
backend survives each answer (docs/kaggle.md, "Where the emulator holds to Kaggle"):

- a version is named `versionLabel: "v<N>"`; the slug `slug/N` is 403, a bare "N" is 404 (kaggle-cli PR #1201);
- a kernel the caller cannot see (absent, or another user's private one) is 403 (kaggle-cli PR #951); the
  relay's first look at its own not-yet-pushed kernel is "absent", refused credentials one line;
- a new kernel's slug comes from its title; a title another kernel has is refused; the relay refuses a title
  that would land elsewhere and checks the `ref` a push answers;
- an unknown machine shape is refused, a retired one is run on its replacement (kaggle-cli PR #1192).
"""
from __future__ import annotations

import json

import pytest

from kaggle_fixtures import FAKE_KEY, USER, backend_for, isolated_env, make_emulator, push_script, wait_state  # noqa: F401
from relay.orchestrator.kaggle import ClientBackend, CredentialsRefused, KaggleCredentials, KaggleError, SessionKernel
from relay.orchestrator.kaggle import kernel_lookup
from relay.orchestrator.kaggle.retry import http_status
from relay.shared.environment import HARDWARE
from relay.shared.errors import InputError


def _rpc(backend: ClientBackend, method: str, slug: str, label: str = None, user: str = USER):
    """One kernels RPC through the SDK as the relay sends it: the reply, or the HTTP status it failed with."""
    from kagglesdk.kernels.types import kernels_api_service as types

    request = {"get_kernel": types.ApiGetKernelRequest, "get_kernel_session_status":
               types.ApiGetKernelSessionStatusRequest,
               "list_kernel_session_output": types.ApiListKernelSessionOutputRequest}[method]()
    request.user_name, request.kernel_slug = user, slug
    if label is not None:
        request.version_label = label
    try:
        return backend.client.sdk(method, lambda kaggle: getattr(kaggle.kernels.kernels_api_client, method)(request))
    except Exception as exc:  # noqa: BLE001
        return http_status(exc)


def _two_versions(backend, kernel: str) -> None:
    for run in ("one-s001-a1", "one-s002-a1"):
        push_script(backend, kernel, f"# relay-run-id: {run}\nprint('ran {run}')\n", gpu=False)
        wait_state(backend, kernel)


def test_a_version_is_named_vN_only_and_the_relay_reads_past_versions_so(make_emulator):
    emu = make_emulator()
    backend = backend_for(emu)
    kernel = f"{USER}/two-versions"
    _two_versions(backend, kernel)
    for method in ("get_kernel", "get_kernel_session_status", "list_kernel_session_output"):
        assert _rpc(backend, method, "two-versions/1") == 403, method  # `kernels pull owner/slug/1` (#1201)
        assert _rpc(backend, method, "two-versions", "1") == 404, method  # a bare number
        assert not isinstance(_rpc(backend, method, "two-versions", "v1"), int), method
    assert "one-s001-a1" in _rpc(backend, "get_kernel", "two-versions", "v1").blob.source
    assert _rpc(backend, "get_kernel", "two-versions", "v9") == 404
    assert backend.version_run(kernel, 1) == "one-s001-a1" and backend.version_run(kernel, 2) == "one-s002-a1"
    assert any("ran one-s001-a1" in e.get("data", "") for e in backend.version_log(kernel, 1))
    # the log stream names no version: one in its path is no route (#1201), as Kaggle answers it
    import requests

    auth = (USER, backend.client.credentials.key)
    assert requests.get(f"{emu.url}/api/v1/kernels/logs/stream/{kernel}/1", auth=auth).status_code == 404
    assert requests.get(f"{emu.url}/api/v1/kernels/logs/stream/{USER}/nothing-here", auth=auth).status_code == 403


def test_a_hidden_kernel_is_403_and_the_relays_first_look_at_its_own_is_absent(make_emulator):
    emu = make_emulator(users={USER: FAKE_KEY, "bob": "bob-key"})
    backend = backend_for(emu)
    bob = ClientBackend(KaggleCredentials("bob", key="bob-key"), emu.url, backend.client.policy)
    push_script(bob, "bob/private-one", "print('mine')\n", gpu=False)  # pushes are private by default
    wait_state(bob, "bob/private-one")
    for method in ("get_kernel", "get_kernel_session_status", "list_kernel_session_output"):
        assert _rpc(backend, method, "not-pushed-yet") == 403, method
        assert _rpc(backend, method, "private-one", user="bob") == 403, method
    assert not isinstance(_rpc(bob, "get_kernel", "private-one", user="bob"), int)  # its owner sees it

    assert backend.current_run(f"{USER}/not-pushed-yet") is None  # a new relay's first tick
    assert backend.current_plan(f"{USER}/not-pushed-yet") is None
    with pytest.raises(KaggleError, match="not found or not accessible"):
        backend.kernel_status(f"{USER}/not-pushed-yet")
    with pytest.raises(KaggleError, match="^kernel bob/private-one: HTTP 403: not found, or alice may not see it"):
        backend.current_run("bob/private-one")

    wrong = ClientBackend(KaggleCredentials(USER, key="not-the-key", source="KAGGLE_KEY"), emu.url,
                          backend.client.policy)
    with pytest.raises(CredentialsRefused) as refused:
        wrong.current_run(f"{USER}/not-pushed-yet")
    assert str(refused.value) == "Kaggle refuses the credentials of alice (KAGGLE_KEY): HTTP 401"
    with pytest.raises(CredentialsRefused):
        wrong.kernel_status(f"{USER}/not-pushed-yet")  # not "not found": the key is what is wrong


def test_a_new_kernel_takes_its_slug_from_its_title_and_a_title_in_use_is_refused(make_emulator):
    emu = make_emulator()
    backend = backend_for(emu)
    pushed = push_script(backend, f"{USER}/asked-slug", "print(1)\n", gpu=False, title="Another Title")
    assert pushed.ref == f"/code/{USER}/another-title" and f"{USER}/asked-slug" not in emu.store.kernels
    refused = push_script(backend, f"{USER}/third-slug", "print(1)\n", gpu=False, title="Another Title")
    assert refused.error == 'The requested title "Another Title" is already in use by a notebook. Please choose' \
                           ' another title.' and not refused.version_number

    # the relay: a title that would land elsewhere is refused before anything is pushed ...
    session = SessionKernel(kernel=f"{USER}/my-relay-session", title="My relay sessions", spec_text="name: x\n",
                            run_id="my-relay-s001-a1", enable_gpu=False)
    with pytest.raises(InputError, match="^kernel title 'My relay sessions': Kaggle would make it the kernel"
                                         f" {USER}/my-relay-sessions, not {USER}/my-relay-session$"):
        backend.push_session(session)
    assert f"{USER}/my-relay-sessions" not in emu.store.kernels


def test_the_relay_checks_the_ref_a_push_answers(make_emulator, monkeypatch):
    """Where Kaggle's slug of a title differs from the client's prediction (python-slugify), the push lands on
    another kernel; the relay says so in one line. The prediction is the one thing replaced here: the
    emulator's own slugify agrees with the client's, so nothing else can make them differ."""
    emu = make_emulator()
    backend = backend_for(emu)
    from relay.orchestrator.kaggle import backend as backend_module

    monkeypatch.setattr(backend_module, "slug_of_title", lambda title: "my-relay-session")
    session = SessionKernel(kernel=f"{USER}/my-relay-session", title="My relay, session two", spec_text="name: x\n",
                            run_id="my-relay-s001-a1", enable_gpu=False)
    with pytest.raises(KaggleError, match=f"^push {USER}/my-relay-session: Kaggle put it at"
                                          f" {USER}/my-relay-session-two "):
        backend.push_session(session)
    assert kernel_lookup.landed_ref("/code/a/b") == "a/b" and kernel_lookup.landed_ref("a/b") == "a/b"
    assert kernel_lookup.landed_ref("") == ""


def _push_shape(backend, kernel: str, shape, gpu: bool = True):
    def push(api):
        import tempfile
        from pathlib import Path

        folder = Path(tempfile.mkdtemp(prefix="push-"))
        (folder / "run.py").write_text("import os\nprint(os.environ.get('%s', 'none'))\n" % HARDWARE)
        meta = {"id": kernel, "title": kernel.split("/")[1].replace("-", " "), "code_file": "run.py",
                "language": "python", "kernel_type": "script", "enable_gpu": gpu, "enable_internet": False}
        if shape:
            meta["machine_shape"] = shape
        (folder / "kernel-metadata.json").write_text(json.dumps(meta))
        return api.kernels_push(str(folder))

    return backend.client.run("push", push)


def test_machine_shapes_unknown_refused_retired_run_on_their_replacement(make_emulator):
    emu = make_emulator()
    backend = backend_for(emu)
    refused = _push_shape(backend, f"{USER}/shape-unknown", "NvidiaTeslaT4x2")
    assert refused.error.startswith("Invalid machine shape 'NvidiaTeslaT4x2': expected one of NvidiaTeslaT4,")
    assert f"{USER}/shape-unknown" not in emu.store.kernels

    for kernel, shape, served, seen in ((f"{USER}/shape-retired", "NvidiaTeslaP100", "NvidiaTeslaT4", 2),
                                        (f"{USER}/shape-none", None, "NvidiaTeslaP100", 1),
                                        (f"{USER}/shape-asked", "NvidiaL4", "NvidiaL4", None)):
        assert _push_shape(backend, kernel, shape).version_number == 1
        wait_state(backend, kernel)
        version = emu.store.kernel_version(kernel)
        assert version["served_shape"] == served, kernel
        printed = "".join(e["data"] for e in backend.version_log(kernel, 1))
        assert (len(json.loads(printed)["gpus"]) if seen else printed.strip()) == (seen or "none"), kernel
    tpu_retired = _push_shape(backend, f"{USER}/shape-old-tpu", "TpuV232", gpu=False)
    assert tpu_retired.version_number == 1 and emu.store.kernel_version(f"{USER}/shape-old-tpu")["served_shape"] is None


def test_the_access_token_file_is_read_as_the_client_reads_it(make_emulator, isolated_env, monkeypatch):
    from relay.orchestrator.kaggle.backend import from_env
    from relay.orchestrator.kaggle.credentials import resolve

    emu = make_emulator(tokens={"tok-from-file": USER})
    home = isolated_env / "home"
    (home / ".kaggle").mkdir()
    with pytest.raises(InputError, match="^no Kaggle credentials: set KAGGLE_API_TOKEN, .*access_token"):
        resolve(env={"HOME": str(home)})
    (home / ".kaggle" / "access_token").write_text("")  # an empty file is passed over, as by the client
    (home / ".kaggle" / "access_token.txt").write_text("tok-from-file\n")
    monkeypatch.setenv("KAGGLE_USERNAME", USER)
    monkeypatch.setenv("KAGGLE_KEY", "a-legacy-key-the-token-wins-over")
    found = resolve()
    assert (found.username, found.token, found.key) == (USER, "tok-from-file", None)
    assert found.source == str(home / ".kaggle" / "access_token.txt")
    assert from_env(emu.url).quota().allowed_s > 0  # sent as a Bearer token, which the emulator takes
    monkeypatch.delenv("KAGGLE_USERNAME")
    with pytest.raises(InputError, match=r"^\S+access_token.txt holds a Kaggle access token but no username comes"
                                         " with it: set KAGGLE_USERNAME$"):
        resolve()
    (home / ".kaggle" / "kaggle.json").write_text(json.dumps({"username": USER, "key": "k"}))
    assert resolve().token == "tok-from-file"  # the username from kaggle.json, the token still first

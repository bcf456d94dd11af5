"""The Kaggle backend: one interface for the orchestrator, implemented over the real `kaggle` client.

Every call retries transient failures (see retry.py). Pushes are idempotent: before pushing, and again after
any failure whose outcome is unknown (a lost response), the kernel's current source is read back and searched
for the run id marker, so one session is never pushed twice. Refusals come back as `PushResult.refusal`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

from relay.orchestrator.kaggle import kernel_lookup, kernel_source, output
from relay.orchestrator.kaggle.bundle import build_bundle
from relay.orchestrator.kaggle.client import KaggleClient
from relay.orchestrator.kaggle.credentials import KaggleCredentials, resolve
from relay.orchestrator.kaggle.datasets import DatasetPublisher, list_dataset_files
from relay.orchestrator.kaggle.retry import RetryPolicy, http_status, unless_absent
from relay.shared import accelerators
from relay.shared.errors import InputError
from relay.shared.spec import DEFAULT_GPU_SHAPE
from relay.orchestrator.kaggle.kernel_lookup import landed_ref, slug_of_title
from relay.orchestrator.kaggle.types import (DatasetFile, KaggleError, KernelState, KernelStatus,
                                             NotFound, PublishResult, PushResult, Quota, Refusal, SessionKernel,
                                             SessionOutput)

log = logging.getLogger(__name__)


class KaggleBackend(Protocol):
    def push_session(self, session: SessionKernel) -> PushResult: ...
    def kernel_status(self, kernel: str, version: Optional[int] = None) -> KernelStatus: ...
    def log_stream(self, kernel: str) -> Iterator[dict]: ...
    def delete_kernel(self, kernel: str) -> bool: ...
    def version_run(self, kernel: str, version: int) -> Optional[str]: ...
    def version_log(self, kernel: str, version: int) -> List[dict]: ...
    def download_output(self, kernel: str, dest: Path, run_id: str, workdir_name: str = "relay",
                        version: Optional[int] = None) -> SessionOutput: ...
    def open_handoff_output(self, kernel: str, root: Path, workdir_name: str = "relay",
                            version: Optional[int] = None) -> Any: ...
    def publish_folder(self, folder: Path, dataset: str, title: str, notes: str = "",
                       known_sha256: Optional[dict] = None, keep_versions: Optional[int] = None) -> PublishResult: ...
    def quota(self) -> Quota: ...
    def list_dataset_files(self, dataset: str, version: Optional[int] = None) -> List[DatasetFile]: ...
    def current_run(self, kernel: str) -> Optional[Tuple[str, Optional[int]]]: ...
    def current_plan(self, kernel: str) -> Optional[dict]: ...
    def current_spec_text(self, kernel: str) -> Optional[str]: ...
    def download_dataset_file(self, dataset: str, name: str, dest: Path,
                              version: Optional[int] = None) -> Path: ...
    def dataset_versions(self, dataset: str) -> List[int]: ...
    def dataset_info(self, dataset: str) -> Optional[dict]: ...
    def create_dataset_if_absent(self, dataset: str, title: str, description: str, files: Dict[str, str]) -> bool: ...
    def new_dataset_version(self, dataset: str, title: str, description: str, files: Dict[str, str],
                            notes: str) -> None: ...
    username: str


def split_ref(ref: str, what: str) -> tuple:
    owner, _, slug = (ref or "").partition("/")
    if not owner or not slug or "/" in slug:
        raise InputError(f"{what} {ref!r}: expected owner/slug")
    return owner, slug


class ClientBackend:
    """Production backend over the `kaggle` client; `endpoint` points it at a local emulator instead."""

    def __init__(self, credentials: Any = None, endpoint: Optional[str] = None,
                 policy: Optional[RetryPolicy] = None, dataset_wait_s: float = 1800.0,
                 dataset_poll_s: float = 5.0):
        creds = credentials if isinstance(credentials, KaggleCredentials) else resolve(credentials)
        self.client = KaggleClient(creds, endpoint, policy)
        self.publisher = DatasetPublisher(self.client, wait_s=dataset_wait_s, poll_s=dataset_poll_s)

    @property
    def endpoint(self) -> Optional[str]:
        """The emulator's URL this backend talks to; None for kaggle.com."""
        return self.client.endpoint

    # -- kernels ---------------------------------------------------------------------------------
    def push_session(self, session: SessionKernel) -> PushResult:
        owner, slug = split_ref(session.kernel, "kernel")
        if len(session.title) < 5:
            raise InputError(f"kernel title {session.title!r}: Kaggle needs at least 5 characters")
        if slug_of_title(session.title) != slug:
            # Kaggle names a new kernel after its title, not the slug pushed (the client only warns)
            raise InputError(f"kernel title {session.title!r}: Kaggle would make it the kernel"
                             f" {owner}/{slug_of_title(session.title)}, not {session.kernel}")
        bundle = build_bundle(user_code=session.code_folder, exclude=session.code_exclude)
        source = kernel_source.render(session, bundle)
        for secret in self.client.credentials.secrets:
            if secret in source:
                raise KaggleError("refusing to push: the kernel source contains the Kaggle credential")
        marker = kernel_source.run_id_marker(session.run_id)

        found = self._pushed_version(owner, slug, marker)
        if found is not None:
            log.info("kernel %s: run %s already pushed (version %s)", session.kernel, session.run_id, found)
            return PushResult(True, found, already_pushed=True, code_version=bundle.code_version)
        busy = self._active_version(session.kernel)
        if busy is not None:
            # a new version does not stop the one running (kaggle-api #388): pushing now would run twice
            return PushResult(False, refusal=Refusal.BUSY, code_version=bundle.code_version,
                              message=f"version {busy[0]} of {session.kernel} is still {busy[1].value}")

        class _Landed(Exception):
            def __init__(self, version: int):
                self.version = version

        def check_landed(_exc: BaseException) -> None:
            # the failed attempt may have reached Kaggle before its response was lost
            version = self._pushed_version(owner, slug, marker)
            if version is not None:
                raise _Landed(version)

        folder = Path(tempfile.mkdtemp(prefix="relay-push-"))
        try:
            (folder / "session.py").write_text(source)
            (folder / "kernel-metadata.json").write_text(json.dumps(self._metadata(session), indent=1))
            timeout = str(session.session_timeout_s) if session.session_timeout_s else None
            response = self.client.run(f"push {session.kernel}",
                                       lambda api: api.kernels_push(str(folder), timeout=timeout),
                                       on_retry=check_landed)
        except _Landed as landed:
            return PushResult(True, landed.version, already_pushed=True, code_version=bundle.code_version)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        error = getattr(response, "error", None)
        version = getattr(response, "version_number", None)
        if error or not version:
            # Kaggle answers a refused push with versionNumber 0 and an error (the CLI still exits 0): nothing
            # runs, so it is a wait-and-retry state; the retry finds the run id marker if it landed after all
            message = error or "push answered without a version number"
            return PushResult(False, refusal=classify_refusal(message), message=message,
                              code_version=bundle.code_version)
        landed = landed_ref(getattr(response, "ref", "") or "")
        if landed and landed != session.kernel:
            raise KaggleError(f"push {session.kernel}: Kaggle put it at {landed} (its slug comes from the title"
                              f" {session.title!r}): the relay never reads that kernel; delete it on Kaggle")
        log.info("kernel %s: pushed run %s as version %s", session.kernel, session.run_id, version)
        return PushResult(True, version, code_version=bundle.code_version)

    @staticmethod
    def _metadata(session: SessionKernel) -> dict:
        sources = [s for s in (session.checkpoint_dataset, session.data_dataset) if s]
        sources += list(session.features_datasets) + list(session.extra_datasets)
        for ref in sources:
            split_ref(ref, "dataset")
        meta = {
            "id": session.kernel, "title": session.title, "code_file": "session.py",
            "language": "python", "kernel_type": "script", "is_private": True,
            "enable_gpu": session.enable_gpu, "enable_tpu": False,
            # the client defaults enable_internet to true: always say it
            "enable_internet": session.enable_internet,
            "dataset_sources": list(dict.fromkeys(sources)), "kernel_sources": [],
            "competition_sources": list(session.competitions),
            "docker_image_pinning_type": "original" if session.pin_image else "latest",  # docs/kaggle.md
        }
        if session.enable_gpu:  # without a shape Kaggle gives a P100, which fails on its current image
            meta["machine_shape"] = session.machine_shape or DEFAULT_GPU_SHAPE
            problem = accelerators.shape_problem(meta["machine_shape"])  # a retired one runs on another machine
            if problem:
                raise InputError(f"kernel {session.kernel}: machine shape {problem}")
        return meta

    def _active_version(self, kernel: str) -> Optional[Tuple[int, KernelState]]:
        """(number, state) of the kernel's current version while it could still run, asked for by its
        version label (an unpinned status can answer an older version's final state for a while)."""
        owner, slug = split_ref(kernel, "kernel")
        response = self._get_kernel(owner, slug)
        number = response.metadata.current_version_number if response and response.metadata else None
        if not number:
            return None
        state = self.kernel_status(kernel, number).state
        return None if state.finished else (number, state)

    def _pushed_version(self, owner: str, slug: str, marker: str) -> Optional[int]:
        """The kernel's current version if its source carries `marker`, else None."""
        response = self._get_kernel(owner, slug)
        source = (response.blob.source if response and response.blob else "") or ""
        if marker not in source:
            return None
        return response.metadata.current_version_number if response.metadata else None

    def _get_kernel(self, owner: str, slug: str, version: Optional[int] = None) -> Any:
        """GetKernel's response (of version `version`, asked as "v<N>"), None when the kernel or version is absent."""
        return kernel_lookup.get_kernel(self.client, owner, slug, version)

    # -- what the relay observes (it keeps no state of its own) ----------------------------------
    @property
    def username(self) -> str:
        return self.client.credentials.username

    def current_run(self, kernel: str) -> Optional[Tuple[str, Optional[int]]]:
        """(run id, version) of the kernel's current version, read back from its pushed source;
        None when the kernel does not exist or was not pushed by the relay."""
        owner, slug = split_ref(kernel, "kernel")
        response = self._get_kernel(owner, slug)
        source = (response.blob.source if response and response.blob else "") or ""
        found = kernel_source.find_run_id(source)
        if found is None:
            return None
        return found, (response.metadata.current_version_number if response.metadata else None)

    def version_run(self, kernel: str, version: int) -> Optional[str]:
        """The run id pushed as version `version` of the kernel (read back from its source), None for none."""
        owner, slug = split_ref(kernel, "kernel")
        response = self._get_kernel(owner, slug, version)
        return kernel_source.find_run_id((response.blob.source if response and response.blob else "") or "")

    def version_log(self, kernel: str, version: int) -> List[dict]:
        """The stored log of a finished kernel version: its events ({"data": ...}) as the log stream gives them."""
        owner, slug = split_ref(kernel, "kernel")
        text = output.list_output(self.client, owner, slug, version)[1]
        try:
            return [entry for entry in json.loads(text or "[]") if isinstance(entry, dict)]
        except ValueError:
            return [{"data": line + "\n"} for line in text.splitlines()]

    def current_plan(self, kernel: str) -> Optional[dict]:
        """The plan (run id, training budget, mounts) embedded in the kernel's current source."""
        owner, slug = split_ref(kernel, "kernel")
        response = self._get_kernel(owner, slug)
        return kernel_source.find_plan((response.blob.source if response and response.blob else "") or "")

    def current_spec_text(self, kernel: str) -> Optional[str]:
        """The run spec (YAML) embedded in the kernel's current source: the one the relay's sessions run with."""
        owner, slug = split_ref(kernel, "kernel")
        response = self._get_kernel(owner, slug)
        return kernel_source.find_spec((response.blob.source if response and response.blob else "") or "")

    def download_dataset_file(self, dataset: str, name: str, dest: Path, version: Optional[int] = None) -> Path:
        """One file of a dataset's current version (or of `version`) into `dest`; NotFound when either is absent."""
        split_ref(dataset, "dataset")
        ref = f"{dataset}/{version}" if version else dataset  # the client reads owner/slug/N as version N
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        def download(api):
            return api.dataset_download_file(ref, name, path=str(dest), force=True)

        unless_absent(lambda: self.client.run(f"download {ref}/{name}", download),
                      NotFound(f"dataset {dataset}: no file {name}"))
        return dest / name

    def kernel_status(self, kernel: str, version: Optional[int] = None) -> KernelStatus:
        """The status of `version` ("v<N>" on the wire); of whatever Kaggle calls current when None,
        which for about a minute after a push can still be the previous version's final state."""
        owner, slug = split_ref(kernel, "kernel")

        def get(kaggle: Any) -> Any:
            from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelSessionStatusRequest

            request = ApiGetKernelSessionStatusRequest()
            request.user_name, request.kernel_slug = owner, slug
            if version is not None:
                request.version_label = f"v{version}"
            return kaggle.kernels.kernels_api_client.get_kernel_session_status(request)

        label = f" v{version}" if version is not None else ""
        try:
            response = self.client.sdk(f"status {kernel}{label}", get)
        except Exception as exc:  # noqa: BLE001 - absent (403 on Kaggle, 404) is NotFound; refused credentials say so
            if kernel_lookup.absent(self.client, exc, owner, slug):
                raise NotFound(f"kernel {kernel}{label}: not found or not accessible") from exc
            raise
        name = getattr(response.status, "name", str(response.status)).lower()
        name = name.removeprefix("kernel_worker_status_")
        state = {"cancel_requested": KernelState.CANCELLED, "cancel_acknowledged": KernelState.CANCELLED}.get(name)
        return KernelStatus(state or KernelState(name), response.failure_message or "")

    def delete_kernel(self, kernel: str) -> bool:
        """Delete the kernel and all its versions (the client's kernels_delete): the only way Kaggle offers to
        stop a running session. False when it was gone already (a retried call whose first answer was lost)."""
        owner, slug = split_ref(kernel, "kernel")

        def delete(kaggle: Any) -> Any:
            from kagglesdk.kernels.types.kernels_api_service import ApiDeleteKernelRequest

            request = ApiDeleteKernelRequest()
            request.user_name, request.kernel_slug = owner, slug
            return kaggle.kernels.kernels_api_client.delete_kernel(request)

        response = unless_absent(lambda: self.client.sdk(f"delete kernel {kernel}", delete), None)
        if response is None:
            return False
        if response.error_message:
            raise KaggleError(f"delete kernel {kernel}: {response.error_message}")
        return True

    def log_stream(self, kernel: str) -> Iterator[dict]:
        """The kernel's log as events ({"data": ...}) through the client's kernels_logs_stream: live server-sent
        events while the session runs, the stored log once it is done; replayed from the start on every call."""
        with self.client.bound() as api:  # the SDK reads this client's endpoint while it connects
            events = api.kernels_logs_stream(kernel)
            first = next(events, None)
        if first is not None:
            yield first
            yield from events

    def download_output(self, kernel: str, dest: Path, run_id: str, workdir_name: str = "relay",
                        version: Optional[int] = None) -> SessionOutput:
        owner, slug = split_ref(kernel, "kernel")
        return output.download(self.client, owner, slug, Path(dest), run_id, workdir_name, version)

    # -- datasets and quota ----------------------------------------------------------------------
    def publish_folder(self, folder: Path, dataset: str, title: str, notes: str = "",
                       known_sha256: Optional[dict] = None, keep_versions: Optional[int] = None) -> PublishResult:
        """`folder` as a new version of `dataset`; given `keep_versions`, one that would keep more versions than that
        deletes the older ones (datasets.py)."""
        split_ref(dataset, "dataset")
        return self.publisher.publish(Path(folder), dataset, title, notes, known_sha256, keep_versions)

    def open_handoff_output(self, kernel: str, root: Path, workdir_name: str = "relay",
                            version: Optional[int] = None):
        """The output of kernel version `version` for a selective, streamed handoff
        (relay/orchestrator/kaggle/selective_output.py)."""
        from relay.orchestrator.kaggle import selective_output

        owner, slug = split_ref(kernel, "kernel")
        return selective_output.open_output(self.client, owner, slug, Path(root), workdir_name, version=version)

    def list_dataset_files(self, dataset: str, version: Optional[int] = None) -> List[DatasetFile]:
        split_ref(dataset, "dataset")
        return list_dataset_files(self.client, dataset, version)

    def dataset_versions(self, dataset: str) -> List[int]:
        """Every published version number of `dataset` (none when it does not exist)."""
        info = self.dataset_info(dataset)
        return sorted(info["notes"]) if info else []

    # -- small datasets written whole (the claims of relay/orchestrator/kaggle/lease.py) ---------
    def dataset_info(self, dataset: str) -> Optional[dict]:
        """{"current", "description", "notes": {version: notes}}; None when the dataset does not exist."""
        split_ref(dataset, "dataset")
        return self.publisher.info(dataset)

    def create_dataset_if_absent(self, dataset: str, title: str, description: str, files: Dict[str, str]) -> bool:
        """Create the private `dataset` holding `files` ({name: text}) in one CreateDataset: True when this call
        created it, False when the slug is taken (by anyone): Kaggle's one atomic create-if-absent."""
        response = self._write_small(dataset, title, description, files, lambda api, folder: api.dataset_create_new(
            folder, public=False, quiet=True, dir_mode="zip"))
        error = getattr(response, "error", None)
        if error and "already" not in error.lower():
            raise KaggleError(f"create dataset {dataset}: {error}")
        return not error

    def new_dataset_version(self, dataset: str, title: str, description: str, files: Dict[str, str],
                            notes: str) -> None:
        """A new version of `dataset` holding `files` ({name: text}), its metadata as given."""
        response = self._write_small(dataset, title, description, files, lambda api, folder: api.dataset_create_version(
            folder, notes, quiet=True, dir_mode="zip"))
        if getattr(response, "error", None):
            raise KaggleError(f"new version of {dataset}: {response.error}")

    def _write_small(self, dataset: str, title: str, description: str, files: Dict[str, str],
                     call: Callable[[Any, str], Any]) -> Any:
        split_ref(dataset, "dataset")
        folder = Path(tempfile.mkdtemp(prefix="relay-dataset-"))
        try:
            for name, text in files.items():
                (folder / name).write_text(text)
            (folder / "dataset-metadata.json").write_text(json.dumps({
                "id": dataset, "title": title, "licenses": [{"name": "CC0-1.0"}], "description": description}))
            return self.client.run(f"write {dataset}", lambda api: call(api, str(folder)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def quota(self) -> Quota:
        response = self.client.run("quota", lambda api: api.quota_view())
        gpu = response.gpu_quota

        def seconds(value: Any) -> float:
            return value.total_seconds() if value is not None else 0.0

        return Quota(used_s=seconds(gpu.time_used) if gpu else 0.0,
                     allowed_s=seconds(gpu.total_time_allowed) if gpu else 0.0,
                     reserved_s=seconds(gpu.time_reserved) if gpu else 0.0,
                     refresh_time=response.quota_refresh_time)


def classify_refusal(error: str) -> Refusal:
    text = error.lower()
    if "session count" in text or "concurrent" in text:
        return Refusal.CONCURRENCY
    if "quota" in text or "hours allowed" in text:
        return Refusal.QUOTA
    return Refusal.OTHER


def from_env(endpoint: Optional[str] = None, credentials: Any = None, **kwargs: Any) -> ClientBackend:
    """A backend with `credentials` or the environment's; RELAY_KAGGLE_ENDPOINT points it at an emulator."""
    return ClientBackend(credentials, endpoint or os.environ.get("RELAY_KAGGLE_ENDPOINT"), **kwargs)

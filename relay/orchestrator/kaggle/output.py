"""Download a kernel's output (every page, every file, retried, size-checked) and tell fresh from stale.

Kaggle can hand back the previous successful run's files after a failed run, so the output counts as this
push's only if its progress.json (written by `relay train`) or relay-kernel.json (written by the entry
script at start) carries the run id the orchestrator chose. The client's `kernels_output` writes error pages
as files and never retries, so the listing goes through the SDK and the files through our own GETs.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, List, Optional, Tuple

from relay.orchestrator.kaggle.client import KaggleClient
from relay.orchestrator.kaggle.kernel_source import MARKER_FILE
from relay.orchestrator.kaggle.retry import call, request_timeout, unless_absent
from relay.orchestrator.kaggle.types import KaggleError, NotFound, SessionOutput
from relay.shared.errors import InputError
from relay.shared.progress import Progress

log = logging.getLogger(__name__)
PAGE_SIZE = 200
DOWNLOAD_MARK = ".relay-output"  # marks a folder this module may replace


def list_output(client: KaggleClient, owner: str, slug: str,
                version: Optional[int] = None) -> Tuple[List[Tuple[str, str]], str]:
    """All (file name, url) pairs of the output of kernel version `version` (the latest when None), and its
    log. Pin the version: right after a push the unpinned listing can still show the previous version's."""
    from kagglesdk.kernels.types.kernels_api_service import ApiListKernelSessionOutputRequest

    files: List[Tuple[str, str]] = []
    token, log_text = "", ""
    while True:
        def page(kaggle: Any, token: str = token) -> Any:
            request = ApiListKernelSessionOutputRequest()
            request.user_name, request.kernel_slug = owner, slug
            request.page_size, request.page_token = PAGE_SIZE, token
            if version is not None:
                request.version_label = f"v{version}"
            return kaggle.kernels.kernels_api_client.list_kernel_session_output(request)

        # a kernel Kaggle will not show (absent, or not the caller's) lists as 403 (kaggle-cli PR #951)
        response = unless_absent(lambda: client.sdk(f"output of {owner}/{slug}", page),
                                 NotFound(f"kernel {owner}/{slug}: not found or not accessible"), (403, 404))
        files += [(f.file_name, f.url) for f in response.files or []]
        log_text = response.log or log_text
        token = response.next_page_token or ""
        if not token:
            return files, log_text


def safe_relative(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts:
        raise KaggleError(f"output file name {name!r} escapes the output folder")
    return path


def fetch(client: KaggleClient, url: str, target: Path) -> None:
    import requests

    def get() -> None:
        with requests.get(url, stream=True, timeout=request_timeout()) as response:
            response.raise_for_status()
            expected = response.headers.get("Content-Length")
            partial = target.with_name(target.name + ".part")
            with open(partial, "wb") as out:
                for chunk in response.iter_content(1 << 20):
                    out.write(chunk)
            if expected is not None and partial.stat().st_size != int(expected):
                raise requests.ConnectionError(f"short read: {partial.stat().st_size} of {expected} bytes")
            os.replace(partial, target)

    call(get, client.policy, f"download {target.name}")


def download(client: KaggleClient, owner: str, slug: str, dest: Path, run_id: str,
             workdir_name: str = "relay", version: Optional[int] = None) -> SessionOutput:
    files, log_text = list_output(client, owner, slug, version)
    if dest.exists() and any(dest.iterdir()) and not (dest / DOWNLOAD_MARK).exists():
        raise InputError(f"output folder {dest} exists and is not an earlier output download: not replacing it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        written = []
        for name, url in files:
            rel = safe_relative(name)
            target = partial.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            fetch(client, url, target)
            written.append(rel.as_posix())
        log_path = dest / f"{slug}.log" if log_text else None
        if log_path:
            (partial / log_path.name).write_text(log_text)
        (partial / DOWNLOAD_MARK).write_text(f"{owner}/{slug}\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # a failed download leaves the earlier one alone
        raise
    if dest.exists():
        shutil.rmtree(dest)
    partial.rename(dest)
    progress = Progress.from_output(_read_json(dest / workdir_name / "progress.json"), f"{owner}/{slug} progress.json")
    marker = _read_json(dest / MARKER_FILE)
    found = (progress.run_id if progress else None) or (marker or {}).get("run_id")
    if found != run_id:
        log.warning("kernel %s/%s: output is from run %s, not %s (stale)", owner, slug, found, run_id)
    return SessionOutput(dest, tuple(written), run_id, found, progress, log_path)


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

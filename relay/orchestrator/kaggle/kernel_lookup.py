"""Reading a kernel back from Kaggle as Kaggle answers it: a version by its label, absence by 403 or 404, and the
slug a title gives.

- A past version is asked for by `version_label = "v<N>"`: GetKernel answers the slug `slug/N` with 403 and a bare
  label "N" with 404 (kaggle-cli #1200, PR #1201, reproduced on 2.2.4).
- A kernel Kaggle will not show answers 403 whether it does not exist or belongs to someone else (kaggle-cli
  PR #951: a wrong slug "returns 403/401 instead of 404"), so the first look at a relay's not-yet-pushed kernel
  is a 403. On the account's own kernel one call that names no kernel (the quota) tells absence from refused
  credentials: if that is refused too, the credentials are, and that is one line (CredentialsRefused).
- Kaggle names a new kernel after its title (the client only warns when the two differ: kaggle_api_extended.py
  kernels_push), so a push's title must slugify to its slug, and the `ref` a push answers is checked.
"""
from __future__ import annotations

from typing import Any, Optional

from relay.orchestrator.kaggle.client import KaggleClient
from relay.orchestrator.kaggle.retry import http_status
from relay.orchestrator.kaggle.types import CredentialsRefused, NotFound


def get_kernel(client: KaggleClient, owner: str, slug: str, version: Optional[int] = None) -> Any:
    """GetKernel's response (metadata + the pushed source; of version `version` when given), None when the kernel
    (or that version) does not exist."""
    def get(kaggle: Any) -> Any:
        from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest

        request = ApiGetKernelRequest()
        request.user_name, request.kernel_slug = owner, slug
        if version:
            request.version_label = f"v{version}"
        return kaggle.kernels.kernels_api_client.get_kernel(request)

    try:
        return client.sdk(f"get kernel {owner}/{slug}", get)
    except Exception as exc:  # noqa: BLE001 - an absent kernel is an answer; anything else goes up as it came
        if not absent(client, exc, owner, slug):
            raise
        return None


def absent(client: KaggleClient, exc: BaseException, owner: str, slug: str) -> bool:
    """Whether a failed read of kernel owner/slug says it does not exist (see the module's docstring); raises
    CredentialsRefused when the account's credentials are refused, NotFound for another user's hidden kernel."""
    status = http_status(exc)
    if status == 404:
        return True
    if status not in (401, 403):
        return False
    if owner.lower() != client.username.lower():
        raise NotFound(f"kernel {owner}/{slug}: HTTP {status}: not found, or {client.username} may not see it") \
            from exc
    if credentials_work(client):
        return True
    raise CredentialsRefused(f"Kaggle refuses the credentials of {client.username}"
                             f" ({client.credentials.source or 'as given'}): HTTP {status}") from exc


def credentials_work(client: KaggleClient) -> bool:
    """Whether Kaggle takes the client's credentials, by a call that names nothing but the account; once they
    worked, they are not asked again."""
    if getattr(client, "credentials_ok", False):
        return True
    try:
        client.run("check credentials", lambda api: api.quota_view())
    except Exception as exc:  # noqa: BLE001
        if http_status(exc) in (401, 403):
            return False
        raise
    client.credentials_ok = True
    return True


def slug_of_title(title: str) -> str:
    """The slug Kaggle gives a kernel of this title, as the `kaggle` client predicts it (python-slugify, one of
    the client's dependencies)."""
    from slugify import slugify

    return slugify(title)


def landed_ref(ref: str) -> str:
    """owner/slug of the kernel a push landed on, from SaveKernel's `ref` ("/code/owner/slug" or "owner/slug");
    "" when it is not of that form."""
    parts = [p for p in ref.split("/") if p]
    parts = parts[1:] if parts[:1] == ["code"] else parts
    return "/".join(parts) if len(parts) == 2 else ""

"""The Kaggle backend (over the real `kaggle` client) and, in `relay.emulator`, a local Kaggle.

Importing this package does not import `kaggle` (it authenticates at import time): that happens lazily, in
a controlled environment, the first time a backend is built (see client.py).
"""
from relay.orchestrator.kaggle.backend import ClientBackend, KaggleBackend, classify_refusal, from_env
from relay.orchestrator.kaggle.credentials import KaggleCredentials
from relay.orchestrator.kaggle.retry import RetryPolicy
from relay.orchestrator.kaggle.types import (CredentialsRefused, DatasetFile, KaggleError, KaggleHTTPError,
                                KaggleUnresponsive, KernelState, KernelStatus, NotFound, PublishError,
                                PublishResult, PushResult, Quota, Refusal, RetriesExhausted, SessionKernel,
                                SessionOutput)

__all__ = [
    "ClientBackend", "CredentialsRefused", "KaggleBackend", "classify_refusal", "from_env", "KaggleCredentials", "RetryPolicy",
    "DatasetFile", "KaggleError", "KaggleHTTPError", "KaggleUnresponsive", "KernelState", "KernelStatus",
    "NotFound", "PublishError", "PublishResult", "PushResult", "Quota", "Refusal", "RetriesExhausted",
    "SessionKernel", "SessionOutput",
]

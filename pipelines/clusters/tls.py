"""`cluster.security` -> a `distributed.Security` (Dask TLS) for the kind the config selects.

Which of the certificate files a kind hands to distributed is the kind's `TLS_ROLES` (pipelines/clusters/<kind>.py):
an existing scheduler needs the CA and the client's cert/key only; a cluster this driver starts also needs the
scheduler's and the workers'.
"""
from __future__ import annotations

import os

from tasks.config import Config, ConfigError

TLS_FILES = ("tls_ca_file", "tls_client_cert", "tls_client_key", "tls_scheduler_cert", "tls_scheduler_key",
             "tls_worker_cert", "tls_worker_key")  # the PEM files of SecurityConfig
CLIENT_ROLES = ("tls_ca_file", "tls_client_cert", "tls_client_key")  # what a client of any scheduler gives


def tls_enabled(sec) -> bool:
    """TLS is set up by `cluster.security` (a SecurityConfig): any file given, or `temporary`, or
    `require_encryption`."""
    return bool(sec.temporary or sec.require_encryption or any(getattr(sec, f) for f in TLS_FILES))


def security(cfg: Config):
    """`cluster.security` -> a `distributed.Security`, or None when it sets nothing up (plain tcp://).

    `Security.temporary()` (one in-memory self-signed certificate for every role; needs `cryptography`), or the
    files of the kind's `TLS_ROLES` (an existing cluster: the CA and the client's cert/key; the embedded cluster:
    also the scheduler's and workers' certs/keys). `require_encryption` is true whenever TLS is set up
    (distributed then refuses plain connections). The values were checked by `pipelines.clusters.checks`.

    Raises:
        ConfigError: `cluster.security.temporary` without the `cryptography` package.
    """
    from pipelines.clusters.kinds import kind_of
    sec = cfg.cluster.security
    if not tls_enabled(sec):
        return None
    from distributed import Security
    if sec.temporary:
        try:
            return Security.temporary()
        except ImportError:
            raise ConfigError("cluster.security.temporary", True, "needs the `cryptography` package (pip install "
                                                                  "cryptography), or give certificate files") from None
    files = {f: os.path.expanduser(getattr(sec, f)) for f in kind_of(cfg).TLS_ROLES if getattr(sec, f)}
    return Security(require_encryption=True, **files)

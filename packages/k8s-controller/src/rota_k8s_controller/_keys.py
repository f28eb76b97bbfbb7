"""The auth key from a Kubernetes Secret, as an owner-only file the rota servers accept.

``rota.auth.load_key`` takes only a regular file (no symbolic link) that nobody but its
owner may read. Kubernetes mounts a Secret through symbolic links (``key ->
..data/key``) and, for a non-root container, readable by the pod's group at best
(fsGroup, mode 0440). ``rota k8s install-key`` runs as an init container under the
same uid as the server: it copies the key into a memory-backed emptyDir as a 0600 file
and checks it with ``load_key`` itself, so a bad Secret fails the pod at once with the
reason instead of the server later.
"""

from __future__ import annotations

import os
import tempfile

from rota.auth import load_key
from rota.errors import ConfigError

__all__ = ["install_key"]

MAX_KEY_FILE = 4096  # a key file is ~45 bytes; anything this long is not one


def install_key(source: str, dest: str) -> None:
    """Copy the key at ``source`` (a Secret's file, links followed) to ``dest`` (mode 0600, replaced atomically).

    :raises ConfigError: naming the file that is missing, unreadable or holds no key; the
        key itself is never quoted.
    """
    try:
        with open(source, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the auth key {source!r} ({exc.strerror}); create the Secret with "
                          "`kubectl create secret generic rota-auth --from-file=key=FILE` in this namespace") from None
    if len(data) > MAX_KEY_FILE:
        raise ConfigError(f"{source!r} is over {MAX_KEY_FILE} bytes: not a key from `rota token keygen`")
    folder = os.path.dirname(os.path.abspath(dest))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".key-")  # 0600, O_EXCL: never an existing file or link
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except OSError as exc:
        os.unlink(tmp)
        raise ConfigError(f"cannot write the auth key to {dest!r} ({exc.strerror})") from None
    try:
        load_key(dest)
    except ConfigError:
        os.unlink(dest)
        raise ConfigError(f"{source!r} holds no auth key: put the file `rota token keygen FILE` made into the "
                          "Secret (key 'key')") from None

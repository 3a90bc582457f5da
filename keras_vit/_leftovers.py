"""Temporary files and folders that a killed process leaves, and their removal.

keras_vit writes large files (exports, downloads) under a temporary name first
and renames them when whole. Such a name carries `owner()`: the process and a
tag of its host. A later call removes the names of processes of this host that
have ended, and keeps those of live processes (a concurrent export or download)
and of other hosts (a shared file system), which it cannot tell apart.
"""

import functools
import hashlib
import os
import shutil
import socket


@functools.cache
def _host():
    return hashlib.sha1(socket.gethostname().encode("utf-8")).hexdigest()[:8]


def owner():
    """PID-HOST for a temporary name of this process."""
    return f"{os.getpid()}-{_host()}"


def _ended(pid):
    """Whether process `pid` of this host has ended (False where that cannot be told)."""
    if os.name != "posix":  # elsewhere os.kill(pid, 0) is not a harmless probe
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def remove_ended(folder, prefix, listdir=os.listdir, delete=None, join=os.path.join):
    """Removes the entries `prefix`PID-HOST-... of `folder` whose process has ended.

    `listdir`, `delete` and `join` reach another file system (TensorFlow's,
    for gs:// paths); by default the local one (`delete`: `remove`).
    """
    delete = remove if delete is None else delete
    try:
        names = [name for name in listdir(folder) if name.startswith(prefix)]
    except Exception:  # noqa: BLE001 (no such folder, or one we may not list: nothing to do)
        return
    for name in names:
        parts = name[len(prefix) :].split("-", 2)
        if len(parts) < 3 or parts[1] != _host() or not parts[0].isdigit():
            continue
        if not _ended(int(parts[0])):
            continue
        try:
            delete(join(folder, name))
        except Exception:  # noqa: BLE001 (removed meanwhile, or refused: left for later)
            pass


def remove(path):
    """Removes the file, link or folder `path`, if there is one."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)

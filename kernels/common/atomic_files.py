"""Files written whole or not at all: a temp file beside the target, synced, then renamed over it. The config tables
(kernels/common/config_tables.py) and the result files (harness/measure/results/store.py) both write through it."""
from __future__ import annotations

import errno
import glob
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(path: Path) -> None:
    """Temp files of `path` left by a writer that was killed (SIGKILL leaves no chance to clean up): their names
    carry the writer's pid, and a pid that no longer runs will not finish them."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


FULL = (errno.EFBIG, errno.ENOSPC, errno.EDQUOT)  # a write the file system refused for its size


def write_atomic(path: Path, write) -> Path:
    """`write(file)` into a temp file beside `path`, fsync, then rename: a reader never sees half a file, a failed
    write leaves no temp file behind (and one a killed writer left is removed by the next write of that name), and
    the file is readable by the owner and the group whatever the umask (0644 under the common one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, (0o666 & ~_umask()) | 0o640)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in FULL and e.filename is None:  # a bare "File too large" names nothing
            raise OSError(e.errno, f"{e.strerror}: a file size limit (ulimit -f), quota or full disk stopped this "
                          "write; nothing of it was kept", str(path)) from None
        raise
    return path

"""Real disk faults for the fault campaign (benchmarks/faults.py): a small tmpfs mounted on a folder of a run, filled
to its last byte or remounted read-only while a ``lowprec`` process waits at a named point (``LOWPREC_FAULTS``
``point_action=stop``), then given its space back (or made writable) for the recovery. The kernel itself then refuses
the run's next write (``ENOSPC``, ``EROFS``): no Python function is patched.

Mounting needs root (or ``CAP_SYS_ADMIN``); ``mount_refused`` says why not where it cannot be done, and the
campaign skips its disk cases with that reason.
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from pathlib import Path

BALLAST = ".ballast"


def _mount(*args: str) -> None:
    p = subprocess.run(["mount", *args], capture_output=True, text=True)
    if p.returncode:
        raise OSError(f"mount {' '.join(args)}: {p.stderr.strip()}")


def mount_refused() -> str | None:
    """None when this process can mount a tmpfs (tried on a temporary folder), else the reason."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    with tempfile.TemporaryDirectory(prefix="lowprec-tmpfs-probe-") as d:
        try:
            _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", d)
        except (OSError, FileNotFoundError) as e:
            return str(e)
        subprocess.run(["umount", d], check=False)
    return None


class Tmpfs:
    """A tmpfs of ``size_mib`` MiB mounted at ``path`` (created if missing) until ``umount``."""

    def __init__(self, path: Path, size_mib: int):
        self.path, self.size_mib = Path(path), size_mib
        self.path.mkdir(parents=True, exist_ok=True)
        _mount("-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(self.path))

    def fill(self) -> int:
        """Write a ballast file until the kernel says ``ENOSPC`` (1 MiB, then 4 KiB, then 1-byte writes: to the last
        byte); returns the bytes written."""
        written = 0
        with open(self.path / BALLAST, "ab", buffering=0) as f:
            for chunk in (1 << 20, 4096, 1):
                block = b"\0" * chunk
                while True:
                    try:
                        written += f.write(block)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
        return written

    def free(self) -> None:
        """Delete the ballast: the space is back."""
        (self.path / BALLAST).unlink(missing_ok=True)

    def read_only(self) -> None:
        """Remount read-only (the kernel refuses while a file on it is open for writing: ``OSError``)."""
        _mount("-o", "remount,ro", str(self.path))

    def writable(self) -> None:
        _mount("-o", "remount,rw", str(self.path))

    def restore(self) -> None:
        """Writable again, with its space back."""
        self.writable()
        self.free()

    def umount(self) -> None:
        """Detach (lazily: a process the campaign killed may still hold a file until it is reaped)."""
        subprocess.run(["umount", "-l", str(self.path)], check=False)

"""The local append-only spool: where events wait, durably, while the audit database is away.

A spool directory holds files named ``audit-spool-<uuid7>.jsonl`` (creation order = name order).
Each file is one process's (an exclusive ``flock`` while alive). A file nobody holds is an orphan
of a process that exited or crashed; the next writer that starts with the same directory adopts it
and replays it before anything newer. The classes are synchronous (the writer calls them through
``asyncio.to_thread``).

- A line is one :meth:`PendingEvent.to_json`; a batch is written then ``fsync``-ed at once.
- ``<file>.pos`` holds the byte offset already replayed, replaced atomically after each replayed
  batch; a crash before that update replays the batch again, and the database skips event ids it
  has (see audit.store), so nothing doubles.
- A torn last line (a write never fsync-ed, so never reported durable) is cut off on adoption; a
  line that does not parse is moved to ``<file>.corrupt``, kept and reported, never stalling the
  rest. An exhausted file is deleted with its ``.pos``.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from audit.errors import SpoolError
from audit.record import PendingEvent, uuid7

__all__ = ["Spool", "SpoolFile"]

log = logging.getLogger(__name__)
_PREFIX = "audit-spool-"
_SUFFIX = ".jsonl"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolFile:
    """One spool file, locked by this process."""

    def __init__(self, path: Path, fd: int, offset: int, pending_events: int) -> None:
        self.path = path
        self._fd = fd
        self._offset = offset
        self._size = os.fstat(fd).st_size
        self.pending_events = pending_events

    @property
    def pos_path(self) -> Path:
        return self.path.with_name(self.path.name + ".pos")

    @property
    def pending_bytes(self) -> int:
        return self._size - self._offset

    @classmethod
    def create(cls, directory: Path) -> SpoolFile:
        name = f"{_PREFIX}{uuid7(datetime.now(UTC))}{_SUFFIX}"
        tmp = directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, directory / name)  # locked before it can be seen under the scanned name
            _fsync_dir(directory)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return cls(directory / name, fd, 0, 0)

    @classmethod
    def try_adopt(cls, path: Path) -> SpoolFile | None:
        """Lock an orphan; None when a live process holds it or it vanished meanwhile."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                os.close(fd)
                return None
        except FileNotFoundError:
            os.close(fd)
            return None
        pos = path.with_name(path.name + ".pos")
        try:
            offset = int(pos.read_text().strip() or 0)
        except FileNotFoundError:
            offset = 0
        except ValueError:
            log.error("audit spool %s: unreadable offset file; replaying it whole (duplicates are skipped)", path)
            offset = 0
        with open(path, "rb") as f:
            data_end = _complete_end(f)
            f.seek(min(offset, data_end))
            pending = f.read(max(0, data_end - offset)).count(b"\n")
        if data_end != os.fstat(fd).st_size:
            log.warning("audit spool %s: cutting a torn last line (never reported durable)", path)
            os.ftruncate(fd, data_end)
            os.fsync(fd)
        return cls(path, fd, min(offset, data_end), pending)

    def append(self, events: Sequence[PendingEvent]) -> None:
        data = "".join(e.to_json() + "\n" for e in events).encode("utf-8")
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        os.fsync(self._fd)
        self._size += len(data)
        self.pending_events += len(events)

    def read(self, max_events: int) -> tuple[list[PendingEvent], int, int]:
        """Up to ``max_events`` events after the replayed offset: (events, new offset, lines)."""
        events: list[PendingEvent] = []
        lines = 0
        offset = self._offset
        with open(self.path, "rb") as f:
            f.seek(offset)
            while len(events) < max_events and offset < self._size:
                line = f.readline()
                if not line.endswith(b"\n"):
                    break
                offset += len(line)
                lines += 1
                try:
                    events.append(PendingEvent.from_json(line.decode("utf-8")))
                except (ValueError, KeyError, TypeError) as exc:
                    self._quarantine(line, exc)
        return events, offset, lines

    def _quarantine(self, line: bytes, exc: Exception) -> None:
        log.error("audit spool %s: unreadable line moved to .corrupt (%s)", self.path, exc)
        fd = os.open(self.path.with_name(self.path.name + ".corrupt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self, offset: int, lines: int) -> None:
        """Record that everything before ``offset`` is in the database."""
        tmp = self.pos_path.with_name(self.pos_path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, str(offset).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.pos_path)
        self._offset = offset
        self.pending_events = max(0, self.pending_events - lines)

    @property
    def exhausted(self) -> bool:
        return self._offset >= self._size

    def remove(self) -> None:
        self.pos_path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
        _fsync_dir(self.path.parent)
        self.release()

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1


def _complete_end(f: BinaryIO) -> int:
    """Offset just past the last newline of the file."""
    end = f.seek(0, os.SEEK_END)
    pos = end
    while pos > 0:
        step = min(65536, pos)
        f.seek(pos - step)
        chunk = f.read(step)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return pos - step + i + 1
        pos -= step
    return 0


class Spool:
    """The ordered spool files of one writer: adopted orphans first, then its own."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._files: list[SpoolFile] = []
        self._own: SpoolFile | None = None

    def open(self) -> None:
        """Create the directory (0700) and adopt the orphans in it, oldest first."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            for path in sorted(self.directory.glob(f"{_PREFIX}*{_SUFFIX}")):
                adopted = SpoolFile.try_adopt(path)
                if adopted is None:
                    continue
                if adopted.exhausted:
                    adopted.remove()
                    continue
                log.warning("audit spool: adopting %s (%d events to replay)", path, adopted.pending_events)
                self._files.append(adopted)
        except OSError as exc:
            raise SpoolError(f"cannot open the audit spool in {self.directory}: {exc}") from exc

    @property
    def has_pending(self) -> bool:
        return bool(self._files)

    @property
    def pending_events(self) -> int:
        return sum(f.pending_events for f in self._files)

    @property
    def pending_bytes(self) -> int:
        return sum(f.pending_bytes for f in self._files)

    def append(self, events: Sequence[PendingEvent]) -> None:
        """Durably append (fsync) after everything already spooled."""
        try:
            if self._own is None:
                self._own = SpoolFile.create(self.directory)
                self._files.append(self._own)
            self._own.append(events)
        except OSError as exc:
            raise SpoolError(f"cannot write the audit spool: {exc}") from exc

    def read(self, max_events: int) -> tuple[SpoolFile, list[PendingEvent], int, int] | None:
        """The oldest unreplayed events: (file, events, offset after them, lines), or None."""
        while self._files:
            head = self._files[0]
            try:
                events, offset, lines = head.read(max_events)
            except OSError as exc:
                raise SpoolError(f"cannot read the audit spool {head.path}: {exc}") from exc
            if lines or not head.exhausted:
                return head, events, offset, lines
            self._drop(head)
        return None

    def commit(self, file: SpoolFile, offset: int, lines: int) -> None:
        try:
            file.commit(offset, lines)
            if file.exhausted:
                self._drop(file)
        except OSError as exc:
            raise SpoolError(f"cannot record spool progress in {file.path}: {exc}") from exc

    def _drop(self, file: SpoolFile) -> None:
        file.remove()
        self._files.remove(file)
        if file is self._own:
            self._own = None

    def close(self) -> None:
        """Release the locks; files with events left stay for the next writer to adopt."""
        for f in self._files:
            f.release()
        self._files.clear()
        self._own = None

"""DCP's file writer made safe for a disk that fills: an error writing any file, on any of the threads DCP
writes with, fails the save on the caller's thread with that error (an OSError), before the checkpoint's metadata is
written. Unchanged, DCP's threads would only print their error as a traceback and the checkpoint would be completed
without that file's data; and torch.save, which writes the tensors, reports a full disk as a RuntimeError that no
longer says so."""

from __future__ import annotations

import contextlib
import io

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem


def write_error(error: BaseException) -> OSError | None:
    """The file-system error that made a write fail (DCP hands a rank's error to every rank inside a
    CheckpointException), or None when it failed for another reason."""
    if isinstance(error, OSError):
        return error
    for failure in getattr(error, "failures", {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, OSError):
            return cause
    return None


class _Discarded(io.RawIOBase):
    """Where DCP writes a file that could not be created: nowhere (the save fails once DCP's threads are done)."""

    def __init__(self):
        super().__init__()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n

    def tell(self) -> int:
        return self.size


class _Watched:
    """A file DCP writes, keeping its first write error (which torch.save hides behind a RuntimeError)."""

    def __init__(self, file):
        self._file, self.error = file, None

    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self):
        try:
            return self._file.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name):
        return getattr(self._file, name)


class _RecordingFileSystem(FileSystem):
    """DCP's file system, with a file's write error recorded instead of raised on the thread that wrote it."""

    def __init__(self):
        super().__init__()
        self.errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        watched = None
        try:
            with super().create_stream(path, mode) as stream:
                watched = _Watched(stream)
                yield watched
        except Exception as e:
            cause = e if isinstance(e, OSError) else watched.error if watched is not None else None
            if cause is None:
                raise
            self.errors.append(cause)
            if watched is None:
                yield _Discarded()  # the file could not be created: its thread goes on writing its data nowhere


class Writer(dcp.FileSystemWriter):
    """dcp.FileSystemWriter that fails, with the first file error of any of its threads, before the checkpoint's
    metadata is written (and again if writing the metadata failed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fs = _RecordingFileSystem()

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        self._raise_recorded()
        if len(written.value()) != len(plan.items):  # a thread of DCP's died of another error, which it printed
            raise RuntimeError("a file of the checkpoint was not written")
        return written

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self._raise_recorded()

    def _raise_recorded(self) -> None:
        if self.fs.errors:
            raise self.fs.errors[0]

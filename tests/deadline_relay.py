"""The relay of tests/deadline.py: shows a test's name only when its deadline fires.

Run as `python -I -S deadline_relay.py PYTEST_PID` with stdin the read end of the pytest process's deadline
pipe and stderr the terminal's. Before each test pytest writes a header frame (NUL, the line, newline); the
relay keeps the last one and prints nothing. Anything else that arrives is faulthandler's dump, written by its
C watchdog thread at the deadline just before `_exit(1)`: the relay prints the kept header, then every byte
of the dump, until the pipe closes. A frame that is a lone NUL and newline says pytest ended normally.

It ends with pytest on every path: at the pipe's end of file (pytest exited or was killed: the kernel closes
its end), at the end frame, or, when something pytest forked still holds the pipe open, within a second of
pytest's death (its parent is no longer PYTEST_PID). Ctrl-C is pytest's to handle: the relay ignores SIGINT
and ends at the end of file that follows. Standard library only, no site: it starts in tens of milliseconds.
"""

from __future__ import annotations

import os
import select
import signal
import sys

POLL_S = 1.0  # how often the relay checks that pytest is still its parent


class Relay:
    def __init__(self) -> None:
        self.header = b""  # the last test's line, shown only if a dump follows it
        self.pending = b""  # an incomplete header frame
        self.dumping = False
        self.ended = False

    def feed(self, chunk: bytes) -> None:
        if self.dumping:
            os.write(2, chunk)
            return
        data = self.pending + chunk
        while data and not self.ended:
            if data[:1] != b"\0":  # not a frame: the dump starts here
                self.dumping = True
                os.write(2, b"\n" + self.header + data)  # the newline: pytest's progress line may be open
                return
            end = data.find(b"\n")
            if end < 0:
                break
            frame, data = data[1 : end + 1], data[end + 1 :]
            if frame == b"\n":
                self.ended = True
            else:
                self.header = frame
        self.pending = data


def main(pytest_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    relay = Relay()
    while not relay.ended:
        ready, _, _ = select.select([0], [], [], POLL_S)
        if not ready:
            if os.getppid() == pytest_pid:
                continue
            # pytest is gone, but a process it forked holds the pipe: take what is there and stop.
            os.set_blocking(0, False)
            try:
                while chunk := os.read(0, 1 << 16):
                    relay.feed(chunk)
            except BlockingIOError:
                pass
            return
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        relay.feed(chunk)


if __name__ == "__main__":
    main(int(sys.argv[1]))

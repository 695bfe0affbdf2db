"""The sink interface and the container that fans each call out to every sink (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar


class Sink:
    """One destination of rank 0's metrics. Every method does nothing unless overridden."""

    name: ClassVar[str] = "sink"  # how a warning names it
    # An essential sink's error ends the run, as it did before sinks (metrics.jsonl: the supervisors and the
    # report read it). Any other sink that raises is dropped for the rest of this start with one warning:
    # curves somewhere else are never worth a run.
    essential: ClassVar[bool] = False

    def record(self, record: Mapping[str, Any]) -> None:
        """One record of metrics.jsonl (read-only: every sink gets the same dict)."""

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Values by tag at optimizer step `step` (None: no value this time)."""

    def close(self) -> None:
        """Flush and close, on every path out of training. Idempotent."""


class Sinks:
    """Every sink of this start, called in order. `warn` says once that a non-essential sink failed."""

    def __init__(self, sinks: list[Sink], warn: Callable[[str], None]) -> None:
        self.sinks: list[Sink] = []
        self.warn = warn
        self.add(sinks)

    def add(self, sinks: list[Sink]) -> None:
        self.sinks.extend(sinks)

    @property
    def curves(self) -> bool:
        """Whether a sink takes `scalars` (the Recorder builds every step's values only then)."""
        return any(type(sink).scalars is not Sink.scalars for sink in self.sinks)

    def record(self, record: Mapping[str, Any]) -> None:
        for sink in list(self.sinks):
            self._call(sink, sink.record, record)

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        for sink in list(self.sinks):
            self._call(sink, sink.scalars, step, values)

    def _call(self, sink: Sink, method: Callable[..., None], *args: Any) -> None:
        if sink.essential:
            method(*args)
            return
        try:
            method(*args)
        except Exception as e:  # noqa: BLE001  (any error of an optional destination: dropped, said once)
            self.sinks.remove(sink)
            self.warn(
                f"{sink.name}: {type(e).__name__}: {e}; nothing more goes there in this start of the run "
                "(metrics.jsonl and the other destinations go on)"
            )
            try:
                sink.close()
            except Exception:  # noqa: BLE001, S110  (already said why it is dropped)
                pass

    def close(self) -> None:
        """Close every sink, each whatever the others do; the first essential sink's error is raised after."""
        sinks, self.sinks = self.sinks, []
        first: BaseException | None = None
        for sink in sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                if sink.essential:
                    first = first or e
                else:
                    self.warn(f"{sink.name} could not be flushed and closed: {type(e).__name__}: {e}")
        if first is not None:
            raise first

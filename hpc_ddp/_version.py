"""The kit's version, in one place: checkpoints, run.json and the doctor's version check record it."""

__version__ = "0.1.0"

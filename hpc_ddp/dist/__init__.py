"""Renamed to `hpc_ddp.cluster` in 0.2: `hpc_ddp.dist.hostlist` keeps working for one release.

Why the rename: ruff, black and pytest skip folders named `dist` by default, and the common Python .gitignore
ignores `dist/` anywhere in a tree, so code in it went unchecked and a new file there could go untracked.
"""

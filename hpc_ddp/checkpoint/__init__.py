"""Checkpoint tools (`python -m hpc_ddp.checkpoint`): `export` turns any checkpoint of a run into a plain
`model.pth`."""

"""The distributed layer: who this process is in the job, where it runs, and the process group it joins.

`hostlist` reads Slurm's node lists, `env` derives ranks and the rendezvous from the launcher's variables,
`placement` picks the GPU and CPUs, `group` joins and tears down the process group. Nothing here knows about
training or about how the job was submitted.
"""

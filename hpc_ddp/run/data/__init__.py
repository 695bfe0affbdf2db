"""The training data of one rank: which samples it reads, in which order, through which loader, after a resume.

feed       its sampler, its loader and workers, and where a resumed epoch goes on
batches    batches of any structure, moved to the rank's device, checked once
loaders    the loader's class: torch's DataLoader, or torchdata's StatefulDataLoader for a stream with state
streams    iterable (streaming) datasets across ranks and workers: each reader its own part
seeding    each batch's generators seeded from where it is: the data's randomness, exact after a resume
workers    DataLoader workers: what they do at start, and how a hang diagnosis reads their stacks
forkrisk   whether this Python can deadlock a forked worker at its start (pure)
options    the data's options: workers, pinned memory, prefetch (no runtime code)
"""

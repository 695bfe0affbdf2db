"""Measure the kit on this machine, side by side with what users would run without it.

    python -m hpc_ddp.bench                        # every section, 5 interleaved trials (about 6 minutes)
    python -m hpc_ddp.bench overhead launch        # some sections only
    python -m hpc_ddp.bench --quick --json b.json  # one short trial each: tests the bench, measures nothing

Every contender runs the built-in `mlp` task (3.4 M parameters) on CPU with gloo, one node, --world-size
ranks (GPUs are hidden from every run). Runs are interleaved, A B C C B A A B C ..., so that a busy neighbour
on a shared machine slows every contender alike and a load that rises or falls during the bench favours
none; each figure is the median over the trials and each ratio the median of the per-trial ratios.

Sections:
  overhead    The kit (`submit --local --nodes 1 --tasks-per-node N`) against a hand-written DDP loop
              (the bench's own, `hand`) on the same model, data, per-rank batch, world size and steps, started
              with `torch.multiprocessing.spawn`: once with torch's default threads (every rank one thread per
              CPU), once with the threads set right by hand (cpus // ranks each). All three measure global
              samples/s the same way: on rank 0, from the end of the first optimizer step (warm-up: DDP builds
              its buckets) to the end of the last; the kit's figure is its metrics.jsonl "end" record. Fair
              settings: the kit runs with --save-every-epochs 0 and --max-steps inside the first epoch, so no
              checkpoint or epoch end falls in the measured window (its final checkpoint comes after it) and
              the hand loops save nothing. The kit's own per-step work (the loss averaged over ranks and the
              signal votes in one all-reduce, the hang watch, metrics) is inside the window: that is the
              overhead measured. Its own time per step is given too: each kit run's end record
              (`kit_us_per_step`: rank 0's step time less its wait for data and less the task's forward,
              backward with DDP's gradient all-reduce, and update, which the loop times with two clock reads
              a block), and apart the part of it that computes the gradient norm the step records carry
              (`grad_norm_us_per_step`: one reduction over the gradients without --clip-grad; with it, the
              clipping's own norm, free). The 0.5 ms budget holds the whole of the kit's own work.
  scaling     Kit samples/s with N ranks against 1 rank pinned to the CPU share one of those ranks gets
              (cpus // N), as an efficiency: samples/s(N) / (N x samples/s(1)). 1.0 would mean the gradient
              all-reduce and the extra processes cost nothing.
  checkpoint  The kit's save path, a checkpoint save of the mlp model in one process that plays rank 0 (RNG
              gather, snapshot to CPU on the training thread; then serialise, write, fsync, rename and fsync
              the folder in the background writer), timed from the call until the checkpoint file is durably
              renamed into place, against a raw sequential write + fsync of the same bytes to the same folder;
              as MB/s and their ratio. The training stall is how long a save holds the training thread. One
              warm-up save is not counted; then 10 x --trials saves (the disk is noisy). Each save and
              each raw write comes right after `os.sync()` and a training step, as a save does in training.
  launch      Command start to the first training step, `submit --local` against `torchrun --standalone
              --nproc-per-node N -m hpc_ddp.train`, same task and flags. "First training step": the
              wall-clock time rank 0 stamps on its metrics.jsonl record of step 1, written right after its
              first optimizer step (--log-every-s 0 makes both runs write it); the start is taken just before
              the command. Also the CPU seconds of each whole command: the local launcher forks its ranks
              from one process that imported torch once; torchrun's agent and every worker import it. And
              the CPU a fresh process spends importing what a rank imports, as a rank does (the collector
              paused, then frozen) against plainly.
  watchdog    What the hang watch costs: kit samples/s with it against without it, in one job of N ranks
              each rank holding the kit's training loop twice. On: the progress beacons, the end-of-backward
              mark (an autograd callback; DDP keeps its built-in C++ all-reduce), the straggler rows in the
              step's packet every 5 steps, a running hang watchdog with --hang-timeout-s auto. Off: no beacons, no mark, no
              straggler check, no watchdog. Both train through the same loop in blocks of 10 steps that alternate A B B A ...
              between the two (whole runs of seconds were too coarse for a 1 % target on a shared machine);
              each trial is --steps steps of each, timed on rank 0, after one uncounted warm-up block each.
              2 x --trials trials; the ratio is the median of the per-trial ratios. Also rank 0's CPU time
              per step in each (its process, every thread): steadier than throughput on a busy machine, it
              shows what the hang watch adds in work alone (no target).
  fsdp        Only when named (minutes, gigabytes; use --world-size 4): a ~100 M-parameter model
              (24 blocks of Linear(2048, 2048), AdamW, given as a factory) trained by ddp with rank 0's full
              checkpoints, by fsdp with sharded asynchronous ones written by a thread, and by fsdp with them
              written by DCP's saving processes (--async-save process), interleaved: samples/s, the loop's
              stall per periodic save, the background write against the save interval, the step time while
              a write is in the background against without one, and each rank's peak RSS, measured twice:
              with the kit's settings (the allocator tunables the launcher starts ranks with) and again
              with freed blocks returned at once and nothing else (GLIBC_TUNABLES with only the 4 MiB
              mmap threshold: what the rank held).
  recovery    Only when named, on a Slurm cluster it may take nodes away from (the local one of
              env/slurm/cluster.sh; skipped, with the reason, where none answers): one node of a running 2-node
              job set DOWN, recovered by today's requeue and in place (--spare-nodes 1: a new step inside the
              allocation), interleaved: seconds from the failure to the next committed step (hpc_ddp/bench/
              recovery.py). About a minute a trial.
  resume      Only when named (minutes): what `python -m hpc_ddp.doctor resume` costs against one uninterrupted
              run of the same options, interleaved: a 200-step task (a linear layer, bench/resuming.py) on
              --world-size ranks whose options make the check try every kind of stop point (2 epochs,
              --grad-accum 2, evaluations, saves). The check's whole command (its two runs, a restart per stop,
              its rerun of the finished run) against the plain run; a restart's start-up is the plain run's
              command start to rank 0's first step. --quick: 8 steps.

  scale       Its own command, with its own options (`python -m hpc_ddp.bench scale --help`): the kit's control
              plane at 1,024 to 8,192 simulated ranks (rendezvous, hang verdict, judge, files per rank, report,
              Slurm calls), each figure's growth, and optionally a real local run with a SIGSTOPped rank
              (docs/scale.md).

Targets (this 2-CPU machine): kit / default-threads loop >= 1.8x; kit / tuned loop >= 0.97x; the kit's
own work per step (rank 0's step less its data wait and the task's forward, backward and update) <= 500 us;
checkpoint >= 0.8x of the raw write; launch <= 1.0x of torchrun;
launch CPU <= 0.75x of torchrun's; rank import paused / plain <= 0.95x; hang watch on / off >= 0.99x (at most 1 % slower);
fsdp / ddp peak memory per rank <= 0.3x with freed memory returned, <= 0.5x with the kit's settings;
fsdp / ddp samples/s >= 0.85x; fsdp / ddp save stall <= 0.1x; recovery in place <= 15 s (median) and <= 0.3x
of the requeue path; resume check <= 3 x the uninterrupted run + its restarts x the start-up of one.
The table and the JSON say which were met. A target whose median misses but whose trials straddle it (some
met it) is "noisy: rerun on a quiet machine", with the trials' range; when every trial misses, it is MISSED,
whatever the machine's load. The exit code is 0 whenever the bench ran (1 if a measured run failed, 2 for a
usage error).
"""

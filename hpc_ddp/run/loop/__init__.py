"""The step and the loop: one rank's epochs of optimizer steps, and what every rank agrees on at each.

    trainer      the training loop: epochs of optimizer steps, agreed stops, evaluations and checkpoints
    forward      a micro-batch's loss, the task's way (`Task.step`, or `loss_fn(model(input), target)`)
    agreed       the one all-reduce of every step: the loss, the signal votes, the straggler windows
    clock        where a step's time goes: the beacon's phase, the straggler window, the kit's own work
    preemption   signals that only take note, and what to do once every rank agreed to stop
    nonfinite    a step whose loss is NaN or infinite on any rank: stop, or skip it everywhere alike
    position     where training stands (`Position`) and how the loop ended (`Outcome`)
    schedules    learning-rate schedules, the kit's or the task's own
    params       the parameters the kit trains, with their names, for the task's optimizer factory
    materialize  a model given as a factory, built without memory where that matters
    rng          every random number generator a step may draw from, saved and restored
    evaluation   exact distributed evaluation: every sample once, means weighted by samples
    evaluator    evaluation inside the loop: when it is due, each rank's exact shard
    best         --keep-best: which evaluation is the best so far (no torch)
    options      the loop's options: evaluation and --keep-best, the schedule (no runtime code)

The data the loop reads is in run/data, what it saves in run/checkpoint, what it writes about itself in
run/records, and what watches it for a hang in run/watch.
"""

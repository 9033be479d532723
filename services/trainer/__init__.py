"""The trainer service: a torchrun group of ranks holding the actor, critic and reference, their optimizers and
checkpoints."""

"""One step of a run's loop: the PPO loop itself and each stage it calls (generation, validation, the warm start,
checkpoints, samples, the prompt sampler, the pipeline ahead of training, the step's metrics)."""

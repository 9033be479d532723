"""The fleet: the services a run uses, as sets (rollout, reward, env), the weight channels and the check after each
sync, the spread of a batch over replicas, the clients of every service, where a swap sends a run."""

"""The agent: multi-turn trajectories, the agent loop and its token-exact turns."""

"""The reward service: stateless scorers (rules, a reward model, users' functions)."""

"""What describes a run: its config, data, the checks before it starts, model loading."""

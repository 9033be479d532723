"""Plumbing shared by every service: config loading, gRPC bootstrap, auth and errors, logging, telemetry, the
tensor codec, the weight channels and weight sync, the code sandbox."""

"""The ``coordctl`` CLI and what only it uses: the local launcher, export, data converters, certificates, the tiny
model, the synthetic task."""

"""The run config's sections, one module per top-level key, every field with a docstring."""

"""A run's lifetime: the runs API, each run's supervising task, its records and their one writer, where its loop
reports, its experiment loggers."""

"""Task decorators: ``@task.advisory_lock`` and the composable ``@advisory_lock``."""

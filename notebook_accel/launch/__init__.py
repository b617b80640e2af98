"""Starting, watching and stopping the workers of a launch (notebook_launcher).

docs/architecture.md says what each module here does and where it runs.

May import: config, platforms, reporting, training, views.
"""

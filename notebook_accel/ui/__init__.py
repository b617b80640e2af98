"""The control panel: choose devices and precision, launch, watch, stop (panel.py).

May import: config, platforms, reporting, launch, views.
"""

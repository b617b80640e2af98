"""Views of a run in the notebook: a live display for launches, and the control panel."""

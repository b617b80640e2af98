"""How a run looks in a notebook: a live view of a launch, drawn from its report.

    state.py    RunView, the base of every view: redraws from the report at a bounded rate
    live.py     the live display of a launch: widgets in a notebook, text in a script
    widgets.py  ipywidgets for progress, metrics, loss curve, ranks and output
    output.py   the workers' output per rank: a rank filter over their newest lines
    plot.py     a line chart as SVG; format.py: numbers as short text

May import: reporting.
"""

"""Starting, watching and stopping the workers of a launch (notebook_launcher).

    launcher.py    notebook_launcher: plan, run, return; running.py: run_plan, last_run
    runs/          runs that outlive the kernel (detach=True): keeper, log, attach
    options.py     every launch option defined once; preflight.py: checks -> plan.py: LaunchPlan
    supervisor.py  the kernel's side of a group of workers; worker.py: the child's side
    processes.py   one handle on every process started; its bootstrap and its end
    fresh.py       workers in fresh interpreters; packing.py: functions and arguments by value
    template.py    workers forked from a clean process started once (after CUDA init);
                   template_server.py: that process; template_messages.py: their socket
    forking.py     the fork lock, descriptors children close, the janitor
    channel.py     worker <-> kernel framing of events; warm.py: warm launches
    debugging.py   a worker's input(), breakpoint() and post-mortem pdb, asked in the cell
    stacks.py      where each rank is when a run makes no progress
    errors.py      WorkerError

May import: config, platforms, reporting, training, views.
"""

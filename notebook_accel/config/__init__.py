"""What a run is configured with, as plain data: no process group, no device.

    settings.py   LaunchSettings, the settings a launch hands to Accelerator() in
                  each worker (through environment variables), and their names
    kwargs.py     Accelerate's configuration classes (DataLoaderConfiguration,
                  ProjectConfiguration, the *Kwargs handlers and plugins)
    optional.py   optional packages: imported on use, or an error naming the pip line
    accelerate_env.py  Accelerate's ACCELERATE_* variables, below our own settings

May import: nothing else of notebook_accel (every other package may import this one).
"""

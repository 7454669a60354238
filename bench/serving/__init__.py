"""The serving benchmark (``python -m bench.serving``): a vLLM-like worker step loop per method. Its ``config`` is
stdlib only (the GPU runner reads it before the project is installed). Roles: ``cli`` is the command line and the run;
``config`` the shapes, load modes, plans and presets, ``model`` the compute, ``blocks`` the block plan, ``methods`` the
engines, ``loop`` the loop and the byte-exact check, ``check`` the per-job checks, ``gpu`` the contiguous copy and the
duplex figure, ``report`` the rows, drift, targets, tables and PNG."""

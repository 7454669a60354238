"""The transfer benchmark (``python -m bench.transfer``): every method on the same blocks, byte-checked, then timed.
Roles: ``cli`` is the command line; ``sweep`` the GPU mode, ``cpu_check`` the CPU mode, ``session`` the state they
share, ``extras`` the CPU cost and interference, ``summary`` the tables and targets; the methods are
:mod:`bench.baselines`, the byte checks, timing and output :mod:`bench.common`."""

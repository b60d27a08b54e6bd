"""Profiler: measured op times, device curves and link fits of this machine, cached in a ProfileDB."""

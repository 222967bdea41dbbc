"""Example environments: ``guess`` (a number-guessing game a tiny model learns) and ``python_tool`` (a code
execution tool under resource limits)."""

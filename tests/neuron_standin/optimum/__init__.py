"""Stand-in for the ``optimum`` namespace (see optimum/neuron/__init__.py here)."""

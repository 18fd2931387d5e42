"""Scripts run by the side environment's interpreter (optimum-neuron 0.4.5; see
tests/neuron_upstream.py). They import upstream code, never the pipeline, and print JSON."""

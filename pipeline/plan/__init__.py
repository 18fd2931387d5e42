"""Planning, before any compile: configs and grids, checkpoint shapes, GQA head padding for
the TP degree, HBM per NeuronCore, traffic traces and fitted buckets, the ``plan`` report.
No torch on this path."""

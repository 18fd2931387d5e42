"""Planning, before any compile: configs and grids, checkpoint shapes, GQA head padding for
the TP degree, HBM per NeuronCore, traffic traces and fitted buckets, the ``plan`` report.
No torch on this path. Fitting a grid to a trace is ``pipeline.plan.fit.fit`` (its module
shares its name, so it is not an attribute here)."""

from pipeline._front_door import front_door

__all__, __getattr__ = front_door(
    __name__,
    {
        "BucketGrid": "buckets",
        "Release": "config",
        "load_config": "config",
        "load_grid": "config",
        "plan_release": "report",
        "plan_gqa": "gqa",
        "read_lengths": "traces",
        "to_grid": "fit",
        "fit_prefill_lengths": "fit",
    },
)

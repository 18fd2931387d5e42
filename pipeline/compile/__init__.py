"""The compile stage (DESIGN.md "compile"): one graph set per bucket, a shared cache.

- ``keys``: cache keys (no torch), also used by ``publish``
- ``shards``: deterministic, cost-balanced splits of the grid
- ``scheduler``: cache lookups, then worker processes in parallel, uploads (``compile_release``)
- ``report``: what a run reports, per bucket and for the weights (``CompileReport``)
- ``workers``: the worker processes, each in a group of its own, and how they are killed
- ``release``: the compiled buckets as a release, published (``publish_release``)
- ``worker``: the child-process entry point, one bucket per process
- ``backends``: cpu/cuda (AOTInductor) and neuron (optimum-cli) behind one interface
- ``decoder``: the exportable Llama/Mistral/Qwen2 decoder behind the cpu/cuda graphs

The graph contract the runtime relies on is ``pipeline.contracts.graph_abi``.
"""

from pipeline._front_door import front_door

__all__, __getattr__ = front_door(
    __name__,
    {
        "compile_release": "scheduler",
        "CompileReport": "report",
        "publish_release": "release",
        "pad_checkpoint": "gqa_pad",
        "shard": "shards",
        "parse_shard": "shards",
    },
)

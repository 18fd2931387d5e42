"""The nouns and formats two or more stages share, below every stage: the bucket, the store's
layout, the graph contract between compile and the runtime, the backend table, the digests
that name a checkpoint, and the checkpoint layout compiled releases use. Nothing here imports
a stage."""

from pipeline._front_door import front_door

__all__, __getattr__ = front_door(
    __name__,
    {
        "Bucket": "bucket",
        "select_bucket": "bucket",
        "GraphSpec": "graph_abi",
        "ABI_VERSION": "graph_abi",
        "BACKENDS": "backend_table",
        "blob_key": "store_layout",
        "release_key": "store_layout",
        "DEFAULT_STORE": "store_layout",
        "weights_digest": "digests",
        "model_config_digest": "digests",
        "fuse_checkpoint": "checkpoint_layout",
        "unfuse_checkpoint": "checkpoint_layout",
    },
)

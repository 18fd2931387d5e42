"""Installing a release on a node: ``pull`` (store → verified files → atomic install) and the
one reader and verifier of an installed release (``installed``). No torch on this path."""

from pipeline._front_door import front_door

__all__, __getattr__ = front_door(
    __name__,
    {
        "pull_release": "pull",
        "land_range": "landing",
        "open_installed": "installed",
        "InstalledRelease": "installed",
    },
)

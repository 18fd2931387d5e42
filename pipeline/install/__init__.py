"""Installing a release on a node: ``pull`` (store → verified files → atomic install) and the
one reader and verifier of an installed release (``installed``). No torch on this path."""
